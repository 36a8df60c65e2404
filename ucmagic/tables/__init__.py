"""Parquet: ``export_parquet`` (write any table as Parquet files, atomically) and ``ParquetDataset``
(stream column batches into PyTorch).

This module stays light: ``export_parquet`` does not import torch; ``ParquetDataset`` (which
does) is loaded on first use from :mod:`ucmagic.parquet_dataset`.
"""
from __future__ import annotations

from typing import Any

from .parquet_export import ExportResult, export_parquet

__all__ = ["ParquetDataset", "export_parquet", "ExportResult"]  # noqa: F822 - ParquetDataset is lazy (__getattr__)


def __getattr__(name: str) -> Any:
    if name == "ParquetDataset":
        from .parquet_dataset import ParquetDataset

        globals()[name] = ParquetDataset
        return ParquetDataset
    raise AttributeError(f"module 'ucmagic.parquet' has no attribute {name!r}")
