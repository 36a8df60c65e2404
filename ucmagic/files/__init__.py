"""The file engine: volumes and listings, the local cache, fetching, epoch plans and ``UCVolumeDataset``.

Read in this order: ``volume`` (where files come from) -> ``listing`` -> ``cache`` -> ``fetch`` ->
``plan`` (pure epoch math) -> ``epochs`` (the planned-dataset contract) -> ``dataset``.
"""
