"""Keeping the trainer's memory small without changing a single number.

Where the cpu-demo's memory goes without these measures (measured with a phase-sampling probe, see
docs/benchmarks.md): the actor's gradient micro-batches kept every decoder block's
activations for the backward (attention and MLP intermediates over ~500-token prompts,
about 5 GB at 4 rows), and the frozen reference policy stayed resident all run
(0.54 GB) next to the policy, its gradients and AdamW's two moments.  The log-prob
passes were already small: they keep the logits of the response positions only
(``logits_to_keep``) and gather the sampled token.

* :func:`checkpointed_blocks` recomputes each decoder block's forward during the
  backward (activation checkpointing) instead of storing it.  The recomputation runs
  the same kernels on the same inputs, so activations, gradients and every later
  number are bit for bit those of the plain backward (tested), at the price of one
  more forward of the blocks per gradient micro-batch.  Unlike Hugging Face's
  ``gradient_checkpointing_enable`` it does not need ``model.train()``: the trainer
  keeps the model in eval mode (see :mod:`.loop`).  Blocks named in ``skip`` run
  normally: the gradient sketcher's forward hooks sit in the last block and must
  fire once per forward.
* :func:`map_large_allocations` stops glibc's heap from fragmenting under the
  activations (blocks of 1 MB and more get their own mmap and go back to the OS when
  freed), and :func:`release_freed_memory` hands freed heap pages back (``malloc_trim``)
  after each phase, so the next phase does not start on top of the last one's
  high-water mark.
* :class:`OptimizerSpill` keeps AdamW's moments in a temporary file between
  optimizer steps.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from contextlib import contextmanager
from typing import Any, Iterable, Iterator

from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["checkpointed_blocks", "decoder_blocks", "release_freed_memory", "map_large_allocations", "peak_rss_bytes",
           "OptimizerSpill", "mapped_large_allocations", "HEAP_LIMIT"]


def decoder_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, block)`` of the model's decoder blocks (empty when none is found)."""
    from icsd_audit.grads.sketch import find_decoder_layers

    try:
        name, blocks = find_decoder_layers(model)
    except ValueError:
        return []
    return [(f"{name}.{i}", b) for i, b in enumerate(blocks)]


@contextmanager
def checkpointed_blocks(model: nn.Module, *, skip: Iterable[str] = ()) -> Iterator[None]:
    """Within the block, forwards of the decoder blocks store only their inputs.

    ``skip``: module names (e.g. the sketcher's layers); a block that is one of them
    or contains one keeps its ordinary forward.
    """
    skip = tuple(skip)
    patched: list[nn.Module] = []
    try:
        for name, block in decoder_blocks(model):
            if any(s == name or s.startswith(name + ".") for s in skip):
                continue
            inner = block.forward

            def forward(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
                return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

            block.forward = forward  # instance attribute shadows the class's forward
            patched.append(block)
        yield
    finally:
        for block in patched:
            del block.forward


_LIBC: Any = None
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


def _libc() -> Any:
    global _LIBC
    if _LIBC is None:
        path = ctypes.util.find_library("c")
        try:
            _LIBC = ctypes.CDLL(path) if path else False
        except OSError:
            _LIBC = False
    return _LIBC


def release_freed_memory() -> bool:
    """Return freed heap memory to the OS where the C library can (glibc); True if it did."""
    trim = getattr(_libc(), "malloc_trim", None) if _libc() else None
    return bool(trim(0)) if trim is not None else False


def map_large_allocations(threshold: int = 1 << 20) -> bool:
    """Serve every allocation of ``threshold`` bytes or more by its own mmap (glibc; True if set).

    glibc raises its mmap threshold to the size of each mapped block freed (up to 32 MB),
    so after the first activations are freed, blocks of a few MB to 32 MB come from the
    heap, where freed space stays resident until the heap's top is free: measured on a
    cpu-demo micro-batch, half the activation memory of the gradient pass was such
    fragmentation (peak 1.6 GB above the weights, 0.76 GB with a fixed 1 MB threshold).
    A fixed threshold turns the adjustment off for the whole process; it changes where
    memory comes from, never a value.
    """
    mallopt = getattr(_libc(), "mallopt", None) if _libc() else None
    return bool(mallopt(_M_MMAP_THRESHOLD, int(threshold))) if mallopt is not None else False


#: glibc's largest dynamic mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX): below it, the heap
HEAP_LIMIT = 32 << 20


@contextmanager
def mapped_large_allocations(threshold: int = 1 << 20) -> Iterator[None]:
    """Within the block, allocations of ``threshold`` bytes or more get their own mmap; after it, the heap again.

    For the actor's gradient pass, whose activations fragment the heap (see
    :func:`map_large_allocations`). Everywhere else a fixed 1 MB threshold costs time: every
    freshly mapped block is zero-filled page by page by the kernel, and the no-grad passes
    (sampling, teacher, reference, ratio pre-pass) allocate and free such blocks in every
    layer; with them on the heap, a freed block is reused without a page fault. Measured on
    the 2-core box (SmolLM2-135M, 4 rows of 400 tokens, one process alternating the two
    settings, 3 rounds): a scoring pass 57 / 64 / 36 s with the 1 MB threshold against
    48 / 30 / 16 s with 32 MB. After the block the threshold is :data:`HEAP_LIMIT` and freed
    heap pages go back to the OS (``malloc_trim``).
    """
    map_large_allocations(threshold)
    try:
        yield
    finally:
        map_large_allocations(HEAP_LIMIT)
        release_freed_memory()


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (Linux/macOS), in bytes."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


class OptimizerSpill:
    """Keeps an optimizer's per-parameter state tensors in an unnamed temporary file between steps.

    AdamW's two moments (twice the weights: 1.08 GB for the 135M model) are read only
    inside ``optimizer.step()``, yet they sat in memory through every rollout, teacher
    pass and gradient micro-batch. ``with spill.resident(): optimizer.step()`` reads them
    back (exact bytes, so the update is bit for bit the same), runs the step and writes
    them out again; so does anything that reads the state (``state_dict()`` for a
    checkpoint). The file is unlinked from the start (``tempfile.TemporaryFile``), so
    nothing is left behind, even after a crash. Cost: one write and one read of the
    moments per optimizer step, from the page cache as long as memory allows.

    ``enabled=False`` makes :meth:`resident` a no-op (the GPU default: moments stay on the device).
    """

    def __init__(self, optimizer: Any, *, enabled: bool = True, directory: str | None = None) -> None:
        self.opt, self.enabled, self.directory = optimizer, enabled, directory
        self._file: Any = None
        self._layout: list[tuple[dict[str, Any], str, tuple[int, ...], Any]] = []

    @property
    def spilled(self) -> bool:
        return bool(self._layout)

    def _spill(self) -> None:
        import tempfile

        import torch

        if self._file is None:
            self._file = tempfile.TemporaryFile(dir=self.directory)
        self._file.seek(0)
        layout = []
        for state in self.opt.state.values():
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0 and value.device.type == "cpu" and value.is_contiguous():
                    self._file.write(value.detach().numpy().reshape(-1).view("uint8").data)
                    layout.append((state, key, tuple(value.shape), value.dtype))
                    state[key] = torch.empty(0, dtype=value.dtype)  # the memory goes back now
        self._file.flush()
        self._layout = layout
        release_freed_memory()

    def _restore(self) -> None:
        import torch

        self._file.seek(0)
        for state, key, shape, dtype in self._layout:
            t = torch.empty(shape, dtype=dtype)
            view = t.numpy().reshape(-1).view("uint8")
            if self._file.readinto(view.data) != view.nbytes:
                raise OSError("optimizer spill file is shorter than what was written to it")
            state[key] = t
        self._layout = []

    @contextmanager
    def resident(self) -> Iterator[None]:
        """Within the block the optimizer's state is in memory, as if never spilled."""
        if not self.enabled:
            yield
            return
        if self.spilled:
            self._restore()
        try:
            yield
        finally:
            self._spill()

    def close(self) -> None:
        if self.spilled:
            self._restore()
        if self._file is not None:
            self._file.close()
            self._file = None
