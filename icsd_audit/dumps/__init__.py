"""Token dumps: the versioned Parquet schema, its streaming reader and validation, the writer
any trainer can call, the synthetic generator and the recomputation of coefficients.

- :mod:`~icsd_audit.dumps.reader` -- path resolution, validation (one-line :class:`DumpError`),
  :class:`DumpReader` streaming one batch at a time, :func:`read_dumps`;
- :mod:`~icsd_audit.dumps.writer` -- :class:`DumpWriter`, atomic shards;
- :mod:`~icsd_audit.dumps.synth` -- GiGPO-like synthetic tokens, labelled synthetic;
- :mod:`~icsd_audit.audit.coeffs` -- ``icsd audit coeffs``: every input column plus g, u, m, c.

The schema itself is ``data_schemas/token_dump.v1.json`` (installed as
``icsd_audit.data_schemas``).
"""

from __future__ import annotations

from icsd_audit.dumps.reader import METADATA_KEY, REQUIRED, DumpError, DumpReader, TokenBatch, read_metadata, resolve_paths
from icsd_audit.dumps.writer import DumpWriter, dump_metadata

__all__ = ["DumpError", "DumpReader", "TokenBatch", "DumpWriter", "dump_metadata", "read_metadata", "resolve_paths",
           "METADATA_KEY", "REQUIRED"]
