"""`quantization_config` in config.json: parse and validate, naming the file and the field on error."""

from __future__ import annotations

from dataclasses import dataclass

from edgeinfer.backend.model.model_config import CheckpointError

EDGEINFER_METHOD = "edgeinfer-w4a16"
PACKING = "uint8-k2-lo-even"           # qweight [N, K//2] uint8, low nibble = even k (kernels' layout)
LAYOUTS = {
    EDGEINFER_METHOD: "edgeinfer: <prefix>.qweight [N,K//2] uint8, .scales/.zeros (or .mins) [N,K//G] fp16",
    "awq": "AutoAWQ GEMM (version 'gemm'): .qweight [K,N//8] int32, .qzeros [K//G,N//8] int32, .scales [K//G,N] fp16",
    "gptq": "GPTQ (checkpoint_format 'gptq' or 'gptq_v2', desc_act false): .qweight [K//8,N] int32, "
            ".qzeros [K//G,N//8] int32, .scales [K//G,N] fp16, optional .g_idx",
    "compressed-tensors": "compressed-tensors format 'pack-quantized', 4-bit int, symmetric, strategy 'group' "
                          "(W4A16, e.g. Kimi-K2-Thinking's experts): .weight_packed [N,K//8] int32 (element i at bits "
                          "4i, stored + 8), .weight_scale [N,K//G], .weight_shape; modules without it stay dense",
}
QWEIGHT = {"compressed-tensors": ".weight_packed"}   # the tensor that marks a quantized module (default .qweight)
SCHEMES = {"w4a16-g128": 128, "w4a16-g64": 64, "w4a16-g32": 32}
OFFSETS = {"zero": "w = (q - zero) * scale, .zeros", "min": "w = q * scale + min, .mins (GGUF Q4_1)"}


@dataclass(frozen=True)
class QuantConfig:
    quant_method: str           # edgeinfer-w4a16 | awq | gptq
    bits: int
    group_size: int             # along K; see packing.effective_group_size for K not divisible
    zero_point: bool            # asymmetric (explicit zeros) vs symmetric (q - 8)
    layout: str                 # edgeinfer | awq-gemm | gptq | gptq_v2
    method: str = ""            # how it was made: rtn | awq | gguf (edgeinfer only)
    offset: str = "zero"        # zero: .zeros, w = (q - zero) * scale | min: .mins, w = q * scale + min

    @property
    def qweight_suffix(self) -> str:
        return QWEIGHT.get(self.layout, ".qweight")

    @classmethod
    def from_dict(cls, raw: object, source: str) -> QuantConfig:
        where = f"{source}: quantization_config"
        if not isinstance(raw, dict):
            raise CheckpointError(f"{where} must be a JSON object, got {type(raw).__name__}")
        qm = raw.get("quant_method")
        if qm not in LAYOUTS:
            raise CheckpointError(f"{where}.quant_method={qm!r} is unsupported; supported layouts: "
                                  + "; ".join(f"{k!r} = {v}" for k, v in LAYOUTS.items()))
        if qm == "compressed-tensors":   # bits and group size per config group
            return cls._compressed_tensors(raw, where)
        bits = raw.get("bits", raw.get("w_bit"))
        if bits != 4:
            raise CheckpointError(f"{where}.bits={bits!r} is unsupported: only 4-bit weights")
        gs = raw.get("group_size", raw.get("q_group_size"))
        if not isinstance(gs, int) or isinstance(gs, bool) or gs < 32 or gs % 32:
            raise CheckpointError(f"{where}.group_size={gs!r} is invalid: expected a positive multiple of 32 "
                                  "(per-channel -1 is unsupported)")
        if qm == EDGEINFER_METHOD:
            zp = raw.get("zero_point")
            if not isinstance(zp, bool):
                raise CheckpointError(f"{where}.zero_point={zp!r} is invalid: expected true or false")
            packing = raw.get("packing")
            if packing != PACKING:
                raise CheckpointError(f"{where}.packing={packing!r} is unsupported; expected {PACKING!r}")
            offset = raw.get("offset", "zero")
            if offset not in OFFSETS:
                raise CheckpointError(f"{where}.offset={offset!r} is unsupported; expected one of: "
                                      + "; ".join(f"{k!r} ({v})" for k, v in OFFSETS.items()))
            if offset == "min" and not zp:
                raise CheckpointError(f"{where}.offset='min' needs zero_point true (a .mins tensor per linear)")
            return cls(qm, 4, gs, zp, "edgeinfer", str(raw.get("method", "")), offset)
        if qm == "awq":
            version = str(raw.get("version", "gemm")).lower()
            if version != "gemm":
                raise CheckpointError(f"{where}.version={version!r} is unsupported; only AutoAWQ 'gemm' packing")
            zp = raw.get("zero_point", True)
            if zp is not True:
                raise CheckpointError(f"{where}.zero_point={zp!r} is unsupported: AutoAWQ GEMM needs zero_point true")
            return cls(qm, 4, gs, True, "awq-gemm")
        fmt = raw.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise CheckpointError(f"{where}.checkpoint_format={fmt!r} is unsupported; expected 'gptq' or 'gptq_v2'")
        if raw.get("desc_act", False):
            raise CheckpointError(f"{where}.desc_act=true (act-order) is unsupported; re-export with desc_act=false")
        return cls(qm, 4, gs, True, fmt)


    @classmethod
    def _compressed_tensors(cls, raw: dict, where: str) -> QuantConfig:
        fmt = raw.get("format")
        if fmt != "pack-quantized":
            raise CheckpointError(f"{where}.format={fmt!r} is unsupported; expected 'pack-quantized' (int4 packed "
                                  "in int32, W4A16)")
        groups = raw.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise CheckpointError(f"{where}.config_groups must be a non-empty object")
        sizes = set()
        for name, g in groups.items():
            w = (g or {}).get("weights") or {}
            at = f"{where}.config_groups.{name}.weights"
            want = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
            bad = {k: w.get(k) for k, v in want.items() if w.get(k) != v}
            if bad:
                raise CheckpointError(f"{at}: {bad} is unsupported; expected {want} (symmetric 4-bit groups)")
            if (g or {}).get("input_activations") is not None:
                raise CheckpointError(f"{where}.config_groups.{name}.input_activations is set: only weight-only "
                                      "(W4A16) checkpoints are supported")
            sizes.add(w.get("group_size"))
        gs = sizes.pop() if len(sizes) == 1 else None
        if not isinstance(gs, int) or isinstance(gs, bool) or gs < 32 or gs % 32:
            raise CheckpointError(f"{where}.config_groups: group_size {sorted(map(str, sizes | {str(gs)}))} is "
                                  "unsupported: expected one positive multiple of 32 for every group")
        return cls("compressed-tensors", 4, gs, False, "compressed-tensors")


def edgeinfer_config(group_size: int, method: str, zero_point: bool = True, **extra) -> dict:
    return {"quant_method": EDGEINFER_METHOD, "bits": 4, "group_size": group_size, "zero_point": zero_point,
            "packing": PACKING, "method": method, "modules_not_converted": ["model.embed_tokens", "lm_head"],
            **extra}
