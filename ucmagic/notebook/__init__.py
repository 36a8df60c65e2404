"""The notebook layer: the ``%ucload`` / ``%ucstage`` / ``%ucckpt`` magics (:mod:`.magics`), the live
loader panel and its text fallback (:mod:`.panel`), the fetch-latency explorer (:mod:`.explorer`) and
matplotlib figures (:mod:`.plots`).

It sits on the engine and holds no engine logic; the engine reaches it only through the lazy imports
of three convenience methods (``DataLoader.monitor()``, ``LoaderStats.plot()``,
``LoaderStats.explore()``), see docs/architecture.md. Importing this package imports nothing else.
"""
