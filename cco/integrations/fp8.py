"""fp8 checkpoints as they ship, for the fused row-parallel layers a framework has sharded.

A framework that loads an fp8 checkpoint without an fp8 kernel of its own dequantizes it (transformers
5.17 on CPU ranks, or with ``FineGrainedFP8Config(dequantize=True)``): every rank holds its shard in
bf16. The fused layer then reads this rank's K shard of the weight from the checkpoint files instead,
the e4m3 bytes and scales as stored (``cco.nn.checkpoint``), so no second fp8 rounding happens.
Unfused equivalent of a layer loaded this way: ``y = all_reduce(x_r @ dequantize(W)[:, K_r].T)``.

:class:`Fp8Checkpoint` is a folder of safetensors files (``model.safetensors`` or the shards listed
in ``model.safetensors.index.json``) with the ``quantization_config`` of its ``config.json``. It opens
one file per weight it reads (``safe_open``: only the two tensors it needs).

Contracts: :meth:`Fp8Checkpoint.row_parallel_shard` reads the same bytes on every rank and its
verdict depends only on the checkpoint, the global shape and the world size, so every rank reaches
the same one; the caller still agrees on it before anything collective (``fused.fuse_linear``), so a
file that one rank cannot read fails every rank instead of leaving the others waiting.
"""

from __future__ import annotations

import json
import os

from cco.nn import checkpoint as C

_FN = "Fp8Checkpoint"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class Fp8Checkpoint:
    """The fp8 weights of a safetensors checkpoint folder, read as they ship.

    ``folder``: a local directory with ``config.json`` and ``model.safetensors`` (or an index and its
    shards). ``config``: its ``quantization_config`` (default: read from ``config.json``)."""

    def __init__(self, folder: str | os.PathLike, *, config: dict | None = None):
        folder = os.fspath(folder)
        if not os.path.isdir(folder):
            raise ValueError(f"{_FN}: folder={folder!r} is not a local directory; pass the checkpoint's folder "
                             f"(for a Hub id: huggingface_hub.snapshot_download(id))")
        self.folder = os.path.abspath(folder)
        if config is None:
            config = read_quantization_config(folder)
        self.config = config
        self.quant = C.config_quant(config)
        self._files = None  # key -> file name, read on first use

    @classmethod
    def of(cls, folder) -> Fp8Checkpoint | None:
        """The checkpoint at ``folder`` when it is a local directory whose config names an fp8 scheme
        cco reads (transformers' ``fp8``, compressed-tensors with 8-bit float weights), else None."""
        if not isinstance(folder, (str, os.PathLike)) or not os.path.isdir(folder):
            return None
        config = read_quantization_config(folder)
        return cls(folder, config=config) if C.config_quant(config) is not None else None

    def __repr__(self):
        return f"Fp8Checkpoint({self.folder!r}, quant={self.quant!r})"

    def files(self) -> dict[str, str]:
        """Checkpoint key -> the safetensors file that holds it."""
        if self._files is None:
            index = os.path.join(self.folder, INDEX)
            if os.path.exists(index):
                with open(index) as f:
                    self._files = dict(json.load(f)["weight_map"])
            elif os.path.exists(os.path.join(self.folder, SINGLE)):
                from safetensors import safe_open

                with safe_open(os.path.join(self.folder, SINGLE), framework="pt") as f:
                    self._files = {key: SINGLE for key in f.keys()}
            else:
                raise ValueError(f"{_FN}: {self.folder} has neither {INDEX} nor {SINGLE}; cco reads safetensors "
                                 f"checkpoints")
        return self._files

    def _key(self, name: str) -> str:
        """The checkpoint key of the module weight ``name``: itself, or the one key that ends with it
        after a prefix (a base model loaded from its task model's checkpoint: ``AutoModel`` names
        ``layers.0...`` what ``model.layers.0...`` holds, the prefix transformers strips on load)."""
        files = self.files()
        if name in files:
            return name
        found = [k for k in files if k.endswith("." + name)]
        if len(found) == 1:
            return found[0]
        raise ValueError(f"{_FN}: no tensor {name!r} in {self.folder} ({len(files)} keys"
                         f"{f'; {len(found)} end with it: ' + ', '.join(found[:4]) if found else ''}); the fused "
                         f"module's name must be its checkpoint key, or the end of one key only (a checkpoint whose "
                         f"keys transformers renames on load otherwise is not read here)")

    def weight(self, key: str) -> C.Fp8Weight | None:
        """The whole fp8 weight ``key`` with its scale (``read_fp8_weight``), or None where the
        checkpoint holds ``key`` in a float dtype (a module the format leaves unquantized)."""
        from safetensors import safe_open

        files = self.files()
        key = self._key(key)
        with safe_open(os.path.join(self.folder, files[key]), framework="pt") as f:
            dtype = f.get_slice(key).get_dtype()
            if dtype in ("BF16", "F16", "F32"):
                return None
            prefix = key[:-len(".weight")] if key.endswith(".weight") else key
            scales = {k: f for k in files if k.startswith(prefix + ".") and k != key}
            if all(files[k] == files[key] for k in scales):
                return C.read_fp8_weight(f, key, config=self.config)
        # the scale sits in another shard file than the weight: read the pair into a dict
        tensors = {}
        for k in [key, *scales]:
            with safe_open(os.path.join(self.folder, files[k]), framework="pt") as g:
                tensors[k] = g.get_tensor(k)
        return C.read_fp8_weight(tensors, key, config=self.config)

    def row_parallel_shard(self, key: str, *, quant: str, rank: int, world: int,
                           in_features_per_rank: int) -> C.Fp8Weight | None:
        """Rank ``rank``'s K shard of the fp8 weight ``key`` in ``quant``'s scales (exact conversions
        only), for a layer of ``in_features_per_rank`` columns per rank: the framework's even split
        (``torch.chunk``). None where ``key`` is stored as a float weight. Raises ValueError where
        the stored scales do not convert exactly to ``quant`` or the split cuts a scale block."""
        fn = f"{_FN}.row_parallel_shard"
        w = self.weight(key)
        if w is None:
            return None
        try:
            w = C.convert_fp8_weight(w, quant)
        except ValueError as err:
            raise ValueError(f"{fn}: {key} is a {w.source} checkpoint weight ({w.quant} scales) and the fused layers "
                             f"were planned with quant={quant!r} ({err}); plan them with quant={w.quant!r} "
                             f"(cco_hf.tp_plan(path) takes the checkpoint's quant by default)") from None
        width = C.shard_width(w, world=world, dim=1)
        if width != in_features_per_rank:
            block = C.block_of(w.quant, 1)
            raise ValueError(f"{fn}: {key} has K={w.shape[1]}; the framework splits it into {world} shards of "
                             f"{in_features_per_rank} columns, which cut its {w.quant} scale blocks of {block} "
                             f"(a shard of whole blocks is {width} wide). Use a tensor-parallel size whose K shard is "
                             f"a multiple of {block}, or keep the framework's own style for this module")
        return C.shard_fp8_weight(w, rank=rank, world=world, dim=1)


def read_quantization_config(folder) -> dict | None:
    """The ``quantization_config`` of ``folder/config.json`` (None where it has none)."""
    path = os.path.join(os.fspath(folder), "config.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f).get("quantization_config")

