"""Models streamed from disk, one unit at a time.

A streamed model is a transformers model built on the ``meta`` device (shapes and dtypes, no
memory), whose weights stay in safetensors files until a unit needs them. A *unit* is one decoder
block, or one module outside the blocks that holds weights of its own (the token embedding, the
final norm, the output head). Running a unit's ``forward`` reads its tensors from disk onto the
compute device just before, and drops them (back to ``meta``) just after, so a whole-model
forward holds one unit's weights at a time and memory does not grow with depth.

Where each tensor lives is a ``TensorStore``: the source's safetensors files, read with plain reads
(``read_tensors``: no memory map, whose pages would count as resident), or the run's *overlay*: the tensors a stage changed, written unit by unit to
new files in a work directory (files are never rewritten, so a fork of the store — the baseline,
a distillation teacher — keeps seeing what it saw).

Every source tensor is checked finite on its first read (``TensorStore.verified``): a NaN weight is
refused naming its file and tensor, with no second pass over the model.

Parameters keep their identity while they come and go (``torch.utils.swap_tensors``), so ties
(``lm_head`` and the token embedding share one Parameter) and ``is`` checks hold.

Stages that work unit by unit (the layer-wise quantizers) hold a unit with ``resident`` and write
what they changed back with ``save``; stages that need the whole model at once call
``materialize`` (the weights are read into memory and the hooks removed: the model is an ordinary
in-memory model from then on).
"""

from __future__ import annotations

import functools
import itertools
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils import swap_tensors

from compress.errors import ModelLoadError
from compress.fsutil import scratch_dir
from compress.heap import return_to_os as _return_to_os
from compress.inputs import check_safetensors, safetensors_data_start
from compress.integrity import check_finite


class ChangedFileError(ModelLoadError):
    """A source file changed after the run opened it (exit 2, naming the file)."""


_ATTR = "_compress_stream"


@dataclass
class TensorStore:
    """Model tensor name -> (safetensors file, key in it). ``overlay`` entries (tensors a stage
    changed) shadow ``source`` ones; ``aliases`` map a name the checkpoint lacks to the one it holds
    (a tied output head reads the embedding)."""

    source: dict[str, tuple[Path, str]]
    aliases: dict[str, str] = field(default_factory=dict)
    overlay: dict[str, Path] = field(default_factory=dict)
    root: Path | None = None
    """Where overlay files go (a folder is made inside it on the first write); None: the system temp dir."""
    stamps: dict[Path, tuple[int, int]] = field(default_factory=dict)
    """(size, mtime_ns) of each source file when it was opened: a file changed since is refused on
    the next read, since the digests in the manifest would no longer describe what the run read."""
    verified: set[tuple[Path, str]] = field(default_factory=set)
    """(file, key) of the source tensors already checked finite (``compress.integrity.check_finite``, on
    their first read); shared with forks, since the source files do not change (``stamps``)."""
    _dir: Path | None = None
    _count: itertools.count = field(default_factory=itertools.count)

    def __contains__(self, name: str) -> bool:
        return name in self.overlay or self.aliases.get(name, name) in self.source

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The tensors ``names`` as stored (their own dtype), read into memory (``read_tensors``)."""
        by_file: dict[Path, list[tuple[str, str]]] = {}
        for name in names:
            if name in self.overlay:
                by_file.setdefault(self.overlay[name], []).append((name, name))
            else:
                file, key = self.source[self.aliases.get(name, name)]
                by_file.setdefault(file, []).append((name, key))
        out: dict[str, torch.Tensor] = {}
        for file, pairs in by_file.items():
            self._check_unchanged(file)
            found = read_tensors(file, [key for _, key in pairs])
            for name, key in pairs:
                if name not in self.overlay:
                    self._check_finite(file, key, found[key])
            out.update({name: found[key] for name, key in pairs})
        return out

    def _check_finite(self, file: Path, key: str, tensor: torch.Tensor) -> None:
        """A source tensor's values, on its first read (the overlay holds what stages computed, not the source)."""
        if (file, key) not in self.verified:
            check_finite(tensor, key, file)
            self.verified.add((file, key))

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of the stored tensor ``name`` (its first dimension), read alone: a slice
        of an output head without the rest of it."""
        file, key = self.location(name)
        self._check_unchanged(Path(file))
        rows = read_rows(Path(file), key, start, stop)
        if name not in self.overlay and (Path(file), key) not in self.verified:
            check_finite(rows, key, file)
        return rows

    def _check_unchanged(self, file: Path) -> None:
        stamp = self.stamps.get(file)
        if stamp is not None:
            now = os.stat(file)
            if (now.st_size, now.st_mtime_ns) != stamp:
                raise ChangedFileError(f"{file} changed while the run was reading it; run again on a file that stays put")

    def write(self, tensors: dict[str, torch.Tensor]) -> None:
        """Put changed tensors in the overlay: one new file, which later reads of these names see."""
        from safetensors.torch import save_file

        if not tensors:
            return
        if self._dir is None:
            self._dir = scratch_dir(self, self.root, "overlay-")
        path = self._dir / f"{next(self._count):06d}.safetensors"
        tmp = path.with_suffix(".tmp")
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp))
        os.replace(tmp, path)
        self.overlay.update(dict.fromkeys(tensors, path))

    def location(self, name: str) -> tuple[str, str]:
        """Where ``name`` is read from: (file, key in it)."""
        if name in self.overlay:
            return str(self.overlay[name]), name
        file, key = self.source[self.aliases.get(name, name)]
        return str(file), key

    def fork(self) -> TensorStore:
        """A store that sees what this one sees now and writes its own overlay from here on.
        Overlay files stay while any store that reads them lives (each store's folder is removed
        when that store is garbage-collected, so a fork keeps a reference to its parent)."""
        child = TensorStore(dict(self.source), dict(self.aliases), dict(self.overlay), self.root, dict(self.stamps), self.verified)
        child._parent = self  # type: ignore[attr-defined]  # keeps the parent's overlay folder alive
        return child

    def __deepcopy__(self, memo: dict) -> TensorStore:
        return self.fork()


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64,
           "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}  # fmt: skip


def safetensors_header(file: Path) -> tuple[dict, int]:
    """A safetensors file's header, checked against the file (``compress.inputs.check_safetensors``),
    and where its data section starts; read once per version of the file (size and mtime)."""
    stat = os.stat(file)
    return _header(str(file), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _header(path: str, size: int, mtime_ns: int) -> tuple[dict, int]:
    header = check_safetensors(Path(path))
    return header, safetensors_data_start(size, header)


def read_tensors(file: Path, keys: list[str]) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file read with plain reads into fresh memory, rather than through a
    memory map: a mapped file's pages count as this process's resident memory while it is mapped
    (a 467 MB embedding would be counted twice while copied out), read pages stay in the page cache."""
    header, data_start = safetensors_header(file)
    out = {}
    with open(file, "rb") as f:
        for key in keys:
            info = header[key]
            tensor = torch.empty(info["shape"], dtype=_DTYPES[info["dtype"]])
            _read_into(f, tensor, data_start + info["data_offsets"][0], f"{file}: {key}")
            out[key] = tensor
    return out


def _read_into(f: Any, tensor: torch.Tensor, at: int, what: str) -> None:
    """Fill ``tensor``'s bytes from ``f`` at offset ``at`` (an OSError naming ``what`` when the file ends first)."""
    size = tensor.numel() * tensor.element_size()
    if size:
        f.seek(at)
        if f.readinto(memoryview(tensor.view(-1).view(torch.uint8).numpy())) != size:
            raise OSError(f"{what} is cut short")


def read_rows(file: Path, key: str, start: int, stop: int) -> torch.Tensor:
    """Rows ``start:stop`` of one tensor of a safetensors file (row-major: one contiguous byte range),
    with a plain read into fresh memory."""
    header, data_start = safetensors_header(file)
    info = header[key]
    shape = info["shape"]
    if not shape or not 0 <= start <= stop <= shape[0]:
        raise ValueError(f"{file}: {key} {shape} has no rows {start}:{stop}")
    tensor = torch.empty([stop - start, *shape[1:]], dtype=_DTYPES[info["dtype"]])
    row_bytes = math.prod(shape[1:]) * tensor.element_size()
    with open(file, "rb") as f:
        _read_into(f, tensor, data_start + info["data_offsets"][0] + start * row_bytes, f"{file}: {key}")
    return tensor


@dataclass
class Unit:
    """What a streamed module knows: its store, its name in the model, where it computes, and how
    many ``resident`` holds keep its weights in memory."""

    store: TensorStore
    prefix: str
    device: torch.device
    holds: int = 0
    shared: list[tuple[str, ...]] = field(default_factory=list)
    """Keys of the tensors this unit holds from ``_SHARED``."""

    def names(self, module: nn.Module) -> list[tuple[str, nn.Module, str, torch.Tensor, bool]]:
        """(full name, owning submodule, attribute, tensor, is_parameter) of every weight in the unit."""
        out = []
        for sub_name, sub in module.named_modules():
            for attr, t in itertools.chain(
                ((a, p) for a, p in sub._parameters.items() if p is not None),
                ((a, b) for a, b in sub._buffers.items() if b is not None and a not in sub._non_persistent_buffers_set),
            ):
                full = ".".join(x for x in (self.prefix, sub_name, attr) if x)
                out.append((full, sub, attr, t, attr in sub._parameters))
        return out


def unit_of(module: nn.Module) -> Unit | None:
    return getattr(module, _ATTR, None)


def _swap(sub: nn.Module, attr: str, tensor: torch.Tensor, value: torch.Tensor, is_param: bool) -> None:
    if is_param:
        swap_tensors(tensor, nn.Parameter(value, requires_grad=tensor.requires_grad))
    else:
        sub._buffers[attr] = value


_SHARED: dict[tuple[str, ...], list] = {}
"""Tensors read for a forward, by (file, key, dtype, device) -> [tensor, units holding it]: while one
is in memory, another model that reads the same stored tensor (the baseline's head and the compressed
model's unchanged head, during evaluation) uses it instead of a second copy. Only read-only loads
share; the entry goes when the last unit holding it drops it."""


def load(module: nn.Module, share: bool = False) -> None:
    """Read the unit's weights from its store onto its device (the ones still on ``meta``). With
    ``share`` (a forward's read-only load), a stored tensor another unit holds now is reused."""
    unit = unit_of(module)
    assert unit is not None
    wanted = [(full, sub, attr, t, p) for full, sub, attr, t, p in unit.names(module) if t.device.type == "meta"]
    if not wanted:
        return
    keys = {full: (*unit.store.location(full), str(t.dtype), str(unit.device)) for full, _, _, t, _ in wanted}
    held = {full: key for full, key in keys.items() if share and key in _SHARED}
    values = unit.store.read([w[0] for w in wanted if w[0] not in held])
    for full, sub, attr, t, is_param in wanted:
        if full in held:
            entry = _SHARED[held[full]]
            entry[1] += 1
            unit.shared.append(held[full])
            _swap(sub, attr, t, entry[0], is_param)
            continue
        value = values[full]
        if tuple(value.shape) != tuple(t.shape):
            raise ValueError(f"{full}: the stored tensor is {tuple(value.shape)}, the model expects {tuple(t.shape)}")
        value = value.to(device=unit.device, dtype=t.dtype)
        _swap(sub, attr, t, value, is_param)
        if share:
            _SHARED[keys[full]] = [value, 1]
            unit.shared.append(keys[full])


def drop(module: nn.Module) -> None:
    """Let go of the unit's weights: back to ``meta`` (the store still has them)."""
    unit = unit_of(module)
    assert unit is not None
    for key in unit.shared:  # let go of shared tensors: the last holder removes the entry
        entry = _SHARED.get(key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] <= 0:
                del _SHARED[key]
    unit.shared.clear()
    freed = 0
    for _, sub, attr, t, is_param in unit.names(module):
        if t.device.type != "meta":
            freed += t.numel() * t.element_size() if t.device.type == "cpu" else 0
            _swap(sub, attr, t, torch.empty(t.shape, dtype=t.dtype, device="meta"), is_param)
    if freed > TRIM_AFTER_BYTES:
        _return_to_os()


TRIM_AFTER_BYTES = 16 * 2**20
"""glibc keeps freed blocks of up to 32 MiB in its heap (its mmap threshold grows with each large
free), so the tensors of dropped units would stay resident: after a unit of more than this many
bytes is dropped, ``malloc_trim`` hands the free pages back to the OS."""


def save(module: nn.Module) -> None:
    """Write the unit's weights (as they are now, in memory) to its store's overlay."""
    unit = unit_of(module)
    assert unit is not None
    unit.store.write({full: t for full, _, _, t, _ in unit.names(module) if t.device.type != "meta"})


def _pre_forward(module: nn.Module, args: tuple) -> None:
    unit = unit_of(module)
    if unit is not None and unit.holds == 0:
        load(module, share=True)


def _post_forward(module: nn.Module, args: tuple, output: object) -> None:
    unit = unit_of(module)
    if unit is not None and unit.holds == 0:
        drop(module)


@contextmanager
def resident(module: nn.Module, device: torch.device | None = None, write_back: bool = False) -> Iterator[nn.Module]:
    """Hold a streamed unit's weights in memory for the block (its forward does not reload or
    drop them); with ``write_back``, what the block changed goes to the overlay on the way out
    (and the weights are the unit's own: never shared with another model's, since they may change).
    A module that is not streamed is yielded as it is (moved to ``device`` when given)."""
    unit = unit_of(module)
    if unit is None:
        if device is not None:
            module.to(device)
        yield module
        return
    old = unit.device
    if device is not None:
        unit.device = torch.device(device)
    unit.holds += 1
    try:
        load(module, share=not write_back)
        yield module
        if write_back:
            save(module)
    finally:
        unit.holds -= 1
        if unit.holds == 0:
            drop(module)
        unit.device = old


def attach(model: nn.Module, store: TensorStore, units: list[str], device: torch.device) -> None:
    """Stream ``model``: each named unit reads its weights at forward time. Everything outside the
    units (rotary tables, non-persistent buffers) is moved to ``device`` now."""
    modules = dict(model.named_modules())
    for prefix in units:
        module = modules[prefix]
        setattr(module, _ATTR, Unit(store, prefix, torch.device(device)))
        module.register_forward_pre_hook(_pre_forward)
        module.register_forward_hook(_post_forward)
    inside = tuple(p + "." for p in units)
    for name, sub in model.named_modules():
        if name in units or name.startswith(inside):
            continue
        for attr, buf in list(sub._buffers.items()):
            if buf is not None and buf.device.type != "meta":
                sub._buffers[attr] = buf.to(device)
    model._compress_streamed = True  # type: ignore[assignment]


def units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if unit_of(m) is not None]


def is_streamed(model: nn.Module) -> bool:
    return bool(units(model))


def set_device(model: nn.Module, device: torch.device) -> None:
    """Where the streamed units compute from now on (the same code serves CPU and CUDA)."""
    for _, m in units(model):
        unit_of(m).device = torch.device(device)  # type: ignore[union-attr]
    for sub in model.modules():
        for attr, buf in list(sub._buffers.items()):
            if buf is not None and buf.device.type != "meta":
                sub._buffers[attr] = buf.to(device)


def materialize(model: nn.Module, device: torch.device | str | None = None) -> nn.Module:
    """Read every unit into memory and stop streaming: an ordinary in-memory model from here on
    (for stages that change shapes, swap modules or train the whole model)."""
    for _, module in units(model):
        unit = unit_of(module)
        assert unit is not None
        if device is not None:
            unit.device = torch.device(device)
        load(module)
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            for key, fn in list(hooks.items()):
                if fn in (_pre_forward, _post_forward):
                    del hooks[key]
        delattr(module, _ATTR)
    if hasattr(model, "_compress_streamed"):
        del model._compress_streamed
    return model


def store_of(model: nn.Module) -> TensorStore | None:
    found = units(model)
    return unit_of(found[0][1]).store if found else None  # type: ignore[union-attr]


def tensors(model: nn.Module, keep_tied: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The state dict as (name, tensor) pairs, one streamed unit read at a time (exports write
    from this without holding the model). A Parameter shared by two names (a tied head) comes
    once, under its first name, unless ``keep_tied``."""
    seen: set[int] = set()
    owner = {}
    for name, module in units(model):
        for full, *_ in unit_of(module).names(module):  # type: ignore[union-attr]
            owner.setdefault(full, (name, module))
    done_units: set[str] = set()
    cache: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if not keep_tied and id(t) in seen:
            continue
        seen.add(id(t))
        if t.device.type != "meta":
            yield name, t.detach()
            continue
        if name not in cache:
            unit_name, module = owner[name]
            if unit_name not in done_units:
                cache.clear()  # one unit's tensors at a time
                store = unit_of(module).store  # type: ignore[union-attr]
                cache.update(store.read([full for full, *_ in unit_of(module).names(module)]))  # type: ignore[union-attr]
                done_units.add(unit_name)
            if name not in cache:  # read once already and let go (a tied name seen again)
                cache.update(unit_of(module).store.read([name]))  # type: ignore[union-attr]
        yield name, cache[name].to(t.dtype)


def owner(model: nn.Module, name: str) -> nn.Module | None:
    """The streamed unit that holds the module or tensor ``name`` (None: not streamed)."""
    modules = dict(model.named_modules())
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        module = modules.get(".".join(parts[:end]))
        if module is not None and unit_of(module) is not None:
            return module
    return None


def to_device(model: nn.Module, device: torch.device | str) -> nn.Module:
    """``model.to(device)`` for a model that may be streamed (its units then compute on ``device``)."""
    if is_streamed(model):
        set_device(model, torch.device(device))
        return model
    return model.to(device)


def compute_device(model: nn.Module) -> torch.device:
    """Where the model computes: its units' device when streamed, else its first parameter's."""
    found = units(model)
    if found:
        return unit_of(found[0][1]).device  # type: ignore[union-attr]
    return next(model.parameters()).device
