"""Loading and writing DeepSeek-V4 checkpoints (bf16, and the real FP8 / MXFP4 formats).

A checkpoint is a folder with ``config.json`` and either one ``*.safetensors`` file or shards
listed by ``model.safetensors.index.json``. The loader reads the safetensors headers (a few KB
each), checks every requested tensor against :mod:`draftgraph.runtime.model.weight_names` and reports *all*
problems in one :class:`WeightError`, then reads only the requested tensors through
``safe_open`` and dequantises FP8 / MXFP4 weights on the target device, or with
``weights="native"`` keeps them as stored (a :class:`~draftgraph.runtime.model.quant.QuantWeight`:
data and UE8M0 scales, no bf16 copy).

Writing (``write_checkpoint``, ``make_synthetic_checkpoint``) lives in
:mod:`draftgraph.runtime.model.checkpoint_writer` and random weights in
:mod:`draftgraph.runtime.model.synthetic_weights`; both
are re-exported here, so ``draftgraph.runtime.model.weights`` is the one import for checkpoint work.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from draftgraph.runtime.device import check_device
from draftgraph.runtime.errors import InputError, WeightError, describe, first_problems
from draftgraph.runtime.model.checkpoint_path import as_path, path_kind
from draftgraph.runtime.model.checkpoint_writer import INDEX_FILE, make_synthetic_checkpoint, write_checkpoint
from draftgraph.runtime.model.config import V4Config
from draftgraph.runtime.model.quant import (
    MXFP4_DATA_DTYPE,
    QuantWeight,
    dequantize_fp8,
    dequantize_mxfp4,
    fp8_scale_shape,
    mxfp4_shapes,
    ue8m0_from_exponents,
)
from draftgraph.runtime.model.sharding import ShardPlan
from draftgraph.runtime.model.synthetic_weights import random_mtp_weights
from draftgraph.runtime.model.weight_names import (
    MTP_PREFIX,
    MTP_TENSOR_NAMES,
    TARGET_TENSOR_NAMES,
    StoredEntry,
    TensorEntry,
    checkpoint_layout,
    scale_name,
    scope_of,
)
from safetensors import SafetensorError, safe_open

__all__ = [
    "Checkpoint",
    "MTP_TENSOR_NAMES",
    "StoredEntry",
    "TARGET_TENSOR_NAMES",
    "TensorEntry",
    "checkpoint_layout",
    "load_checkpoint",
    "make_synthetic_checkpoint",
    "random_mtp_weights",
    "write_checkpoint",
]

SCALE_DTYPES = ("F8_E8M0", "U8", "F32")  # UE8M0 bytes, or plain fp32 factors (V3 style)
WEIGHT_MODES = ("bf16", "native")  # load_checkpoint's weights=: dequantise at load, or keep as stored
MXFP4_DTYPES = ("I8", "U8", "F4")
ACCEPTED = {"bf16": ("BF16", "F16", "F32"), "fp32": ("F32",), "int32": ("I32", "I64")}
DAMAGED_HINT = "the file is truncated or not a safetensors file: copy or write it again"
CHECKPOINT_PATH = "a folder or a .safetensors file"  # what load_checkpoint takes, in its errors


@dataclass
class Checkpoint:
    """Loaded tensors of one checkpoint.

    Attributes
    ----------
    config : the model config (from ``config.json`` unless one was passed).
    tensors : name -> tensor on the requested device; bf16 (quantised weights dequantised, or
        with ``weights="native"`` a QuantWeight as stored), fp32 (``hc_*``, ``attn_sink``,
        gate bias) or int32 (``tid2eid``).
    source : name -> stored format, ``"bf16"`` / ``"fp8"`` / ``"mxfp4"`` / ``"fp32"`` / ``"int32"``.
    path : the folder or file loaded.

    Example
    -------
    >>> ckpt = load_checkpoint("ckpt/")
    >>> ckpt.mtp("e_proj.weight").shape
    torch.Size([256, 256])
    """

    config: V4Config
    tensors: dict[str, torch.Tensor]
    source: dict[str, str] = field(default_factory=dict)
    path: Path | None = None
    bytes_read: int = 0  # tensor bytes read from the files (data and scales; a head slice's rows only)
    shard: ShardPlan | None = None  # the rank's part loaded (None: everything requested)

    @property
    def nbytes(self) -> int:
        """Bytes of the loaded tensors (a QuantWeight's data and scales)."""
        return sum(tensor_bytes(t) for t in self.tensors.values())

    def mtp(self, name: str) -> torch.Tensor:
        """``tensors["mtp.0." + name]``."""
        return self[MTP_PREFIX + name]

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise WeightError(
                describe(
                    "checkpoint tensor",
                    "one of the loaded names",
                    repr(name),
                    "pass names= to load_checkpoint to load it",
                )
            )
        return self.tensors[name]

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __repr__(self) -> str:
        formats = sorted(set(self.source.values()))
        return f"Checkpoint({len(self.tensors)} tensors, {self.nbytes / 2**20:.1f} MiB, formats {formats})"


# ---- loading ---------------------------------------------------------------------------------


def load_checkpoint(
    path: str | Path,
    config: V4Config | None = None,
    *,
    names: str | Iterable[str] | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    strict: bool | None = None,
    weights: str = "bf16",
    shard: ShardPlan | None = None,
) -> Checkpoint:
    """Load the requested tensors of a checkpoint, dequantising FP8 and MXFP4 weights (or keeping them).

    Parameters
    ----------
    path : a folder (config.json + safetensors) or one ``.safetensors`` file.
    config : overrides ``config.json`` (required when ``path`` is a file without one beside it).
    names : ``None`` or ``"mtp"`` (the draft-step set), ``"target"``, ``"all"``, or explicit names.
    device : where the tensors end up; quantised weights are dequantised there.
    dtype : dtype of the bf16-kind tensors (fp32 and int32 tensors keep theirs).
    strict : also reject tensors the checkpoint holds under a requested scope (``mtp.0.``,
        ``layers.i.``) that the model does not have. Default: on for the named sets, off for
        explicit names.
    weights : ``"bf16"`` dequantises FP8 / MXFP4 weights to ``dtype``; ``"native"`` keeps them
        as stored, each a QuantWeight (data + UE8M0 scales). Weights stored in bf16 stay bf16.
    shard : load only one rank's part (runtime/model/sharding.py): its routed experts, its rows of
        ``head.weight`` (read as a slice: the other rows are never read), the shared expert on
        rank 0 only. ``bytes_read`` says what was read.

    Raises
    ------
    InputError : ``weights`` is neither "bf16" nor "native", ``config`` no V4Config, ``device`` none
        the runtime runs on (before anything is read).
    WeightError : no config or safetensors, or one error listing every missing, unexpected or
        misshapen tensor; native weights whose fp32 scales are not powers of two.
    """
    if weights not in WEIGHT_MODES:
        raise InputError(describe("weights", " or ".join(map(repr, WEIGHT_MODES)), repr(weights),
                                  "'native' keeps FP8 / MXFP4 as stored, 'bf16' dequantises at load"))
    if config is not None and not isinstance(config, V4Config):
        raise InputError(describe("config", "a V4Config, or None to read config.json", type(config).__name__))
    device = check_device(device)
    root, files = _locate(as_path(path, "checkpoint path", CHECKPOINT_PATH))
    if config is None:
        config = V4Config.load(root)
    entries, default_strict = _requested(config, names)
    strict = default_strict if strict is None else strict
    catalogue = _read_catalogue(files)
    plan, problems = _check(entries, catalogue, strict)
    if shard is not None and shard.is_sharded:  # checked whole (a missing tensor is missing on every rank)
        entries = [e for e in entries if shard.holds(e.name)]
        plan = [(e, fmt) for e, fmt in plan if shard.holds(e.name)]
    if problems:
        raise WeightError(_problems_message(path, problems))
    tensors: dict[str, torch.Tensor] = {}
    source: dict[str, str] = {}
    by_file: dict[Path, list[tuple[TensorEntry, str]]] = {}
    for entry, fmt in plan:
        by_file.setdefault(catalogue[entry.name][0], []).append((entry, fmt))
    rows = {"head.weight": shard.vocab_rows} if shard is not None and shard.is_sharded else {}
    read = [0]
    for file, items in by_file.items():
        try:
            with safe_open(str(file), framework="pt") as handle:
                for entry, fmt in items:
                    tensors[entry.name] = _materialise(handle, catalogue, entry, fmt, device, dtype, weights,
                                                       rows.get(entry.name), read)
                    source[entry.name] = fmt
        except (SafetensorError, OSError) as exc:  # the headers were checked: this is a damaged file
            raise WeightError(
                describe(f"safetensors file {file}", "tensors its header describes", repr(exc), DAMAGED_HINT)
            ) from exc
    ordered = {e.name: tensors[e.name] for e in entries}
    return Checkpoint(config=config, tensors=ordered, source=source, path=Path(path), bytes_read=read[0],
                      shard=shard if shard is not None and shard.is_sharded else None)


def _locate(path: Path) -> tuple[Path, list[Path]]:
    kind = path_kind(path, "checkpoint path", CHECKPOINT_PATH)
    if kind == "file" and path.suffix == ".safetensors":
        return path.parent, [path]
    if kind == "file":  # config.json or the index given for the folder: say so, do not parse it as tensors
        raise WeightError(describe("checkpoint path", CHECKPOINT_PATH, f"the file {str(path)!r}",
                                   "give the folder that holds config.json and the safetensors"))
    if kind != "dir":
        raise WeightError(
            describe("checkpoint path", CHECKPOINT_PATH, f"nothing at {path}")
        )
    index = path / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({path / f for f in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise WeightError(
                describe(f"shard index {index}", 'JSON with a "weight_map" of name -> file', repr(exc))
            ) from exc
        absent = [f.name for f in files if path_kind(f, f"shard listed in {index}", "a file beside it") is None]
        if absent:
            raise WeightError(describe(f"shards listed in {index}", "files beside it", f"{absent} missing"))
        return path, files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightError(
            describe(
                f"checkpoint {path}",
                "a *.safetensors file or model.safetensors.index.json",
                "no safetensors file",
                "write one with write_checkpoint or make_synthetic_checkpoint",
            )
        )
    return path, files


def _requested(config: V4Config, names: str | Iterable[str] | None) -> tuple[list[TensorEntry], bool]:
    if names is None or names == "mtp":
        return MTP_TENSOR_NAMES(config), True
    if names == "target":
        return TARGET_TENSOR_NAMES(config), True
    if names == "all":
        return _dedupe(MTP_TENSOR_NAMES(config) + TARGET_TENSOR_NAMES(config)), True
    wanted = "None, 'mtp', 'target', 'all' or a list of names"
    if isinstance(names, str) or not isinstance(names, Iterable):
        raise WeightError(describe("names", wanted, repr(names)))
    names = list(names)
    if not all(isinstance(n, str) for n in names):
        raise WeightError(describe("names", wanted, f"a list holding {sorted({type(n).__name__ for n in names})}"))
    known = {e.name: e for e in MTP_TENSOR_NAMES(config)}
    if any(n not in known for n in names):  # only then build the (larger) target list
        known.update((e.name, e) for e in TARGET_TENSOR_NAMES(config))
    unknown = [n for n in names if n not in known]
    if unknown:
        raise WeightError(
            describe(
                "requested tensors",
                "V4 tensor names",
                f"unknown {unknown}",
                "see MTP_TENSOR_NAMES / TARGET_TENSOR_NAMES",
            )
        )
    return [known[n] for n in names], False


def _dedupe(entries: list[TensorEntry]) -> list[TensorEntry]:
    return list({e.name: e for e in entries}.values())


def _read_catalogue(files: list[Path]) -> dict[str, tuple[Path, str, tuple[int, ...]]]:
    """name -> (file, stored dtype, shape), from the JSON headers only (no tensor data)."""
    catalogue: dict[str, tuple[Path, str, tuple[int, ...]]] = {}
    duplicates = []
    for file in files:
        for name, (dtype, shape) in _read_header(file).items():
            if name in catalogue:
                duplicates.append(f"{name} in {catalogue[name][0].name} and {file.name}")
            catalogue[name] = (file, dtype, shape)
    if duplicates:
        raise WeightError(
            describe("checkpoint shards", "each tensor in one file", f"duplicates {duplicates[:5]}")
        )
    return catalogue


def _read_header(file: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    # The safetensors layout: an 8-byte little-endian header length n, n bytes of JSON
    # {name: {dtype, shape, data_offsets}}, then the data, which the offsets must cover exactly.
    # Checked against the file size here, so that a truncated or foreign file is one WeightError
    # before any tensor is read (unchecked, a random length asks for exabytes).
    what = f"safetensors file {file}"
    try:
        file_bytes = file.stat().st_size
        with open(file, "rb") as fh:
            prefix = fh.read(8)
            if len(prefix) < 8:
                raise WeightError(describe(what, "an 8-byte header length", f"{file_bytes} byte(s)", DAMAGED_HINT))
            (length,) = struct.unpack("<Q", prefix)
            if length > file_bytes - 8:
                raise WeightError(
                    describe(what, f"a header length <= {file_bytes - 8} (the bytes after it)", length, DAMAGED_HINT)
                )
            header = json.loads(fh.read(length))
    except OSError as exc:
        raise WeightError(describe(what, "a readable file", repr(exc))) from exc
    except ValueError as exc:  # not UTF-8 or not JSON
        raise WeightError(describe(what, "a JSON header", repr(exc), DAMAGED_HINT)) from exc
    if not isinstance(header, dict):
        raise WeightError(describe(what, "a JSON object as header", type(header).__name__, DAMAGED_HINT))
    header.pop("__metadata__", None)
    catalogue, data_end = {}, 0
    for name, meta in header.items():
        try:
            dtype, shape, (begin, end) = meta["dtype"], tuple(meta["shape"]), meta["data_offsets"]
            valid = isinstance(dtype, str) and all(isinstance(n, int) and n >= 0 for n in (*shape, begin, end))
        except (KeyError, TypeError, ValueError):
            valid = False
        if not valid or begin > end:
            raise WeightError(
                describe(f"{what} entry {name!r}", "{dtype, shape, data_offsets}", repr(meta)[:200], DAMAGED_HINT)
            )
        catalogue[name] = (dtype, shape)
        data_end = max(data_end, end)
    if data_end != file_bytes - 8 - length:
        raise WeightError(
            describe(
                what,
                f"{data_end} bytes of tensor data after the header (its data_offsets)",
                f"{file_bytes - 8 - length}",
                DAMAGED_HINT,
            )
        )
    return catalogue


def _problems_message(path, problems: list[str]) -> str:
    """The first problems (``first_problems``) and the hint on the first line, then all, one a line."""
    shown = first_problems(problems)
    first = describe(
        f"checkpoint {path}",
        "the tensors config.json describes",
        f"{len(problems)} problem(s) with the requested tensors: {shown}",
        "check that config.json matches the checkpoint, or pass names= / strict=False",
    )
    return first + "\n  - " + "\n  - ".join(problems)


def _check(
    entries: list[TensorEntry], catalogue: dict, strict: bool
) -> tuple[list[tuple[TensorEntry, str]], list[str]]:
    """Match every entry with its stored form; collect every problem instead of stopping."""
    plan, problems, expected = [], [], set()
    for entry in entries:
        expected.add(entry.name)
        fmt, issue = _stored_format(entry, catalogue)
        if fmt in ("fp8", "mxfp4"):
            expected.add(scale_name(entry.name))
        if issue:
            problems.append(issue)
        else:
            plan.append((entry, fmt))
    if strict:
        scopes = {scope_of(e.name) for e in entries} - {""}
        for name in sorted(catalogue):
            if scope_of(name) in scopes and name not in expected:
                _, dtype, shape = catalogue[name]
                problems.append(
                    describe(
                        f"unexpected {name}",
                        f"no such tensor under {scope_of(name)!r}",
                        f"{dtype}{list(shape)}",
                    )
                )
    return plan, problems


def _stored_format(entry: TensorEntry, catalogue: dict) -> tuple[str | None, str | None]:
    """(format, problem): how ``entry`` is stored, or why it cannot be loaded."""
    got = catalogue.get(entry.name)
    if got is None:
        return None, describe(
            f"missing {entry.name}", _spelt(_plain_dtype(entry.kind), entry.shape), "no such tensor"
        )
    _, dtype, shape = got
    if entry.kind not in ("fp8", "mxfp4") or dtype in ACCEPTED["bf16"]:
        kind = entry.kind if entry.kind not in ("fp8", "mxfp4") else "bf16"
        if dtype not in ACCEPTED[kind] or shape != entry.shape:
            return None, describe(
                f"misshapen {entry.name}", _spelt(_plain_dtype(kind), entry.shape), _spelt(dtype, shape)
            )
        return kind, None
    if dtype == "F8_E4M3":
        fmt, want, want_scale = "fp8", entry.shape, fp8_scale_shape(entry.shape)
    elif dtype in MXFP4_DTYPES:
        try:
            (want, want_scale), fmt = mxfp4_shapes(entry.shape), "mxfp4"
        except InputError as exc:  # a width MXFP4 cannot hold: report it with the rest
            return None, describe(f"misshapen {entry.name}", "a width divisible by 32 for MXFP4", str(exc))
    else:
        return None, describe(
            f"misshapen {entry.name}",
            f"BF16, F8_E4M3 or I8 (MXFP4) {list(entry.shape)}",
            _spelt(dtype, shape),
        )
    if shape != want:
        return fmt, describe(
            f"misshapen {entry.name}",
            f"{dtype}{list(want)} ({fmt} of {list(entry.shape)})",
            _spelt(dtype, shape),
        )
    scale = catalogue.get(scale_name(entry.name))
    if scale is None:
        return fmt, describe(
            f"missing {scale_name(entry.name)}", f"F8_E8M0{list(want_scale)} ({fmt} scales)", "no such tensor"
        )
    if scale[1] not in SCALE_DTYPES or scale[2] != want_scale:
        return fmt, describe(
            f"misshapen {scale_name(entry.name)}", f"F8_E8M0{list(want_scale)}", _spelt(scale[1], scale[2])
        )
    return fmt, None


def _materialise(handle, catalogue, entry: TensorEntry, fmt: str, device, dtype: torch.dtype,
                 weights: str = "bf16", rows: tuple[int, int] | None = None,
                 read: list[int] | None = None) -> torch.Tensor | QuantWeight:
    if rows is not None:  # a rank's slice of a bf16 tensor's rows (the vocab-parallel head): only they are read
        if fmt in ("fp8", "mxfp4"):
            raise WeightError(describe(f"{entry.name} rows", "a bf16 tensor to slice by rows", fmt))
        raw = read_rows(catalogue[entry.name][0], entry.name, *rows)
    else:
        raw = handle.get_tensor(entry.name)
    if read is not None:
        read[0] += raw.nbytes
    raw = raw.to(device)
    if fmt in ("fp8", "mxfp4") and read is not None:  # its scales, read once below
        _, scale_dtype, scale_shape = catalogue[scale_name(entry.name)]
        read[0] += math.prod(scale_shape) * (4 if scale_dtype == "F32" else 1)
    if weights == "native" and fmt in ("fp8", "mxfp4"):
        scale = _ue8m0(entry, _read_scale(entry, catalogue, handle, device))
        data = raw if fmt == "fp8" else raw.view(torch.uint8).view(MXFP4_DATA_DTYPE)
        return QuantWeight(data, scale, fmt)
    if fmt == "fp8":
        return dequantize_fp8(raw, _read_scale(entry, catalogue, handle, device), dtype)
    if fmt == "mxfp4":
        return dequantize_mxfp4(raw, _read_scale(entry, catalogue, handle, device), dtype)
    target = {"fp32": torch.float32, "int32": torch.int32}.get(fmt, dtype)
    return raw.to(target)


STORED_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def read_rows(file: Path, name: str, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of tensor ``name`` in a safetensors ``file``: one read of exactly their bytes.

    (safetensors' ``get_slice`` materialises the whole tensor's storage on CPU and views the rows.)
    """
    with open(file, "rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        meta = json.loads(fh.read(length))[name]
    dtype, shape = STORED_DTYPES[meta["dtype"]], tuple(meta["shape"])
    row_bytes = math.prod(shape[1:]) * dtype.itemsize
    data = read_byte_range(file, 8 + length + meta["data_offsets"][0] + start * row_bytes, (stop - start) * row_bytes)
    return torch.frombuffer(data, dtype=dtype).view(stop - start, *shape[1:])


def read_byte_range(file: Path, offset: int, size: int) -> bytearray:
    """``size`` bytes of ``file`` from ``offset`` (the one primitive ``read_rows`` reads through)."""
    data = bytearray(size)
    with open(file, "rb") as fh:
        fh.seek(offset)
        if fh.readinto(data) != size:
            raise WeightError(describe(f"safetensors file {file}", f"{size} bytes at {offset}", "fewer", DAMAGED_HINT))
    return data


def _ue8m0(entry: TensorEntry, scale: torch.Tensor) -> torch.Tensor:
    """A stored scale as ``float8_e8m0fnu``: UE8M0 / U8 bytes as they are, fp32 factors when powers of two."""
    if scale.dtype in (torch.float8_e8m0fnu, torch.uint8):
        return scale.view(torch.float8_e8m0fnu)
    mantissa, exponent = torch.frexp(scale.float())
    if not bool((mantissa == 0.5).all()):
        raise WeightError(describe(f"{scale_name(entry.name)} (fp32 scales)", "powers of two, to keep as UE8M0",
                                   "factors that are not", "load it with weights='bf16' (dequantised at load)"))
    return ue8m0_from_exponents(exponent - 1)


def tensor_bytes(t) -> int:
    """Bytes a loaded tensor holds: a QuantWeight's data and scales, or a tensor's."""
    return t.nbytes if isinstance(t, QuantWeight) else t.numel() * t.element_size()


def _read_scale(entry: TensorEntry, catalogue, handle, device) -> torch.Tensor:
    name = scale_name(entry.name)
    file = catalogue[name][0]
    if file == catalogue[entry.name][0]:
        return handle.get_tensor(name).to(device)
    with safe_open(str(file), framework="pt") as other:  # a scale sharded away from its weight
        return other.get_tensor(name).to(device)


def _plain_dtype(kind: str) -> str:
    return {"fp32": "F32", "int32": "I32"}.get(kind, "BF16")


def _spelt(dtype: str, shape: tuple[int, ...]) -> str:
    return f"{dtype}{list(shape)}"
