"""Mixture-of-Experts layer: the router (Qwen3-MoE's softmax top-k; GLM-4.5's and DeepSeek-V3's sigmoid scores with
a selection-only correction bias, group-limited top-k, renormalization and a routed scaling factor), the routed
experts and the shared experts.

The experts run grouped: the (token, slot) pairs of a step are sorted by expert once (`ExpertOrder`), every expert
runs once over the rows it was chosen for, and the outputs are weighted and summed back into token order. There is
no loop over tokens. Three ways to run the experts, one math:
  - `DenseExperts` (fp32/bf16 weights [E, 2I, H] and [E, H, I]): one GEMM per expert that has rows.
  - `Int4Experts` on CPU, prepacked: one kernels.cpu call per layer (`q4_1x8_moe`: the sort by expert, the gate/up
    and down grouped GEMMs over every expert's Q4_1 x8 slab, silu(gate) * up and the weighted sum per token).
  - `Int4Experts` on CUDA (fp16/bf16): kernels.fused_moe_w4a16 (Triton; token-sorted grouped GEMMs, gate/up and
    SiLU fused in the first); elsewhere its pure-torch reference, which dequantizes each expert.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import edgeinfer.kernels.cpu as cpu_kernels
from edgeinfer import kernels
from edgeinfer.backend.model.linear import kernel_takes, mins_as_zeros
from edgeinfer.backend.model.model_config import MoEConfig
from edgeinfer.backend.model.packing import group_dequantize_mins
from edgeinfer.kernels.moe_route import route_topk
from edgeinfer.kernels.w4a16_gemm import group_dequantize_tensor


def route(logits: torch.Tensor, moe: MoEConfig, correction_bias: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] fp32, expert ids [T, k] int64), as transformers computes them
    (kernels/moe_route.py: softmax top-k for Qwen3-MoE; sigmoid scores with a selection-only correction bias,
    group-limited top-k, renormalization and a routed scaling factor for GLM-4.5 and DeepSeek-V3)."""
    return route_topk(logits, moe.top_k, moe.scoring != "softmax", moe.n_group, moe.topk_group, moe.norm_topk_prob,
                      moe.routed_scaling_factor, correction_bias)


@dataclass
class ExpertOrder:
    """The step's (token, slot) pairs sorted by expert: pair p = token * k + slot; `pairs[i]` is the i-th pair in
    expert order, `tokens[i]` its token, expert e owns sorted rows offsets[e] .. offsets[e + 1]."""
    pairs: torch.Tensor     # [T*k] int64
    tokens: torch.Tensor    # [T*k] int64
    offsets: torch.Tensor   # [E + 1] int64
    counts: list[int]       # rows per expert (host copy: the loops over experts skip the empty ones)

    @classmethod
    def of(cls, ids: torch.Tensor, num_experts: int) -> ExpertOrder:
        """ids -1 (an expert on another rank, expert parallelism) sort last, past every expert's rows."""
        flat = ids.reshape(-1)
        flat = torch.where(flat >= 0, flat, num_experts)
        pairs = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=num_experts + 1)
        offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
        offsets[1:] = counts[:num_experts].cumsum(0)
        return cls(pairs, pairs // ids.shape[1], offsets, counts[:num_experts].tolist())

    def combine(self, rows: torch.Tensor, weights: torch.Tensor, num_tokens: int) -> torch.Tensor:
        # rows past the experts' (pairs of experts on other ranks) are zero; weights of such pairs are zeroed too
        """rows [T*k, H] in expert order -> [T, H]: each row times its routing weight, summed per token. The rows
        go back to pair order with one gather (CPU index_add_ runs as a scatter_add_, measured 0.33 ms for 8 rows
        of 768, more than an expert's GEMM), then each token's k rows are summed."""
        inverse = torch.empty_like(self.pairs)
        inverse[self.pairs] = torch.arange(self.pairs.numel(), device=self.pairs.device)
        by_pair = rows.index_select(0, inverse).view(num_tokens, -1, rows.shape[1])
        return (by_pair * weights.to(rows.dtype)[:, :, None]).sum(1)


class DenseExperts(nn.Module):
    """gate_up [E, 2I, H] (gate rows first), down [E, H, I]: transformers' fused-expert layout."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__()
        self.gate_up = nn.Parameter(gate_up, requires_grad=False)
        self.down = nn.Parameter(down, requires_grad=False)

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.gate_up, self.down))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        order = ExpertOrder.of(ids, self.num_experts)
        xs = x.index_select(0, order.tokens)
        rows = torch.zeros(xs.shape[0], self.down.shape[1], dtype=x.dtype, device=x.device)
        start = 0
        for e, n in enumerate(order.counts):
            if n:
                gate, up = (xs[start:start + n] @ self.gate_up[e].t()).chunk(2, dim=-1)
                rows[start:start + n] = (nn.functional.silu(gate) * up) @ self.down[e].t()
                start += n
        return order.combine(rows, weights, x.shape[0])


def _stack(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    return None if parts[0] is None else torch.stack(parts).contiguous()  # type: ignore[arg-type]


class Int4Experts(nn.Module):
    """INT4 routed experts, per expert in W4A16Linear's layout stacked along a leading expert dim: qweight
    [E, N, K//2] uint8 (low nibble = even k), scales [E, N, K//G] fp16 and either zeros (w = (q - zero) * s),
    mins (w = q * s + min, GGUF Q4_1) or neither (symmetric, w = (q - 8) * s). gate_up is [E, 2I, H] (gate rows
    first), down [E, H, I]. Buffers, so the model's weight_bytes and .to() see them; None once prepacked."""

    _NAMES = ("gu_q", "gu_s", "gu_z", "gu_m", "dn_q", "dn_s", "dn_z", "dn_m")
    gu_q: torch.Tensor            # buffers (register_buffer in __init__); None once prepacked
    gu_s: torch.Tensor
    gu_z: torch.Tensor | None
    gu_m: torch.Tensor | None
    dn_q: torch.Tensor
    dn_s: torch.Tensor
    dn_z: torch.Tensor | None
    dn_m: torch.Tensor | None
    gu_x8: torch.Tensor | None
    dn_x8: torch.Tensor | None
    num_experts: int
    intermediate: int
    hidden: int

    def __init__(self, gate_up: tuple, down: tuple, group_size: int) -> None:
        super().__init__()
        for name, t in zip(self._NAMES, (*gate_up, *down)):
            self.register_buffer(name, t)
        for a, b in ((self.gu_z, self.gu_m), (self.dn_z, self.dn_m)):
            if a is not None and b is not None:
                raise ValueError("Int4Experts takes zeros or mins, not both")
        self.group_size = group_size
        self.num_experts = int(self.gu_q.shape[0])
        self.intermediate = int(self.gu_q.shape[1]) // 2
        self.hidden = int(self.dn_q.shape[1])
        self.register_buffer("gu_x8", None)   # CPU prepack: [E, ceil(2I/8), H/32 * 160]
        self.register_buffer("dn_x8", None)   # [E, ceil(H/8), I/32 * 160]
        self.residual_activations = False
        self.second_pass_tau = 0.0   # as W4A16Linear's
        self._kernel_args: tuple | None = None   # kernel_form() for forward, computed once (as W4A16Linear's)

    @classmethod
    def from_linears(cls, gate_up: list, down: list) -> Int4Experts:
        """From one fused gate_up and one down W4A16Linear per expert (the quantized loader's modules)."""
        def stack(mods: list) -> tuple:
            return (_stack([m.qweight for m in mods]), _stack([m.scales for m in mods]),
                    _stack([m.zeros for m in mods]), _stack([m.mins for m in mods]))
        groups = {m.group_size for m in gate_up + down}
        if len(groups) != 1:
            raise ValueError(f"experts quantized with different group sizes {sorted(groups)}")
        return cls(stack(gate_up), stack(down), groups.pop())

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers())

    @staticmethod
    def _mins(s: torch.Tensor, z: torch.Tensor | None, m: torch.Tensor | None) -> torch.Tensor:
        """The Q4_1 offset: m itself; symmetric: -8 s (exact in fp16); zero points: -z * s rounded to fp16
        (within 2^-11 of the offset, relative: the block format holds fp16, as llama.cpp's Q4_1)."""
        if m is not None:
            return m
        if z is None:
            return (-8.0 * s.float()).half()
        return (-z.float() * s.float()).half()

    def prepack(self) -> bool:
        """CPU: pack every expert's Q4_1 form into kernels.cpu's x8 layout, [E, ceil(N/8), K/32 * 160], for the
        grouped GEMM, and free the plain buffers. Where the group is not a multiple of 32, the device is not the
        CPU or kernels.cpu is off, False: the reference path runs."""
        if self.prepacked:
            return True
        if self.gu_q.device.type != "cpu" or self.group_size % cpu_kernels.BLOCK or not cpu_kernels.enabled():
            return False
        gu_m, dn_m = self._mins(self.gu_s, self.gu_z, self.gu_m), self._mins(self.dn_s, self.dn_z, self.dn_m)

        def pack(q, s, m) -> torch.Tensor:
            return torch.stack([cpu_kernels.pack_q4_1x8(cpu_kernels.pack_q4_1(q[e], s[e], m[e], self.group_size))
                                for e in range(self.num_experts)]).contiguous()
        self.gu_x8, self.dn_x8 = pack(self.gu_q, self.gu_s, gu_m), pack(self.dn_q, self.dn_s, dn_m)
        self.residual_activations = cpu_kernels.activations() == "int8x2"
        self.second_pass_tau = cpu_kernels.second_pass_tau()
        for name in self._NAMES:
            setattr(self, name, None)
        return True

    @property
    def prepacked(self) -> bool:
        return self.gu_x8 is not None

    def _plain(self) -> None:
        if self.prepacked:
            raise RuntimeError("Int4Experts: prepacked for kernels.cpu; the plain weights were freed")

    def kernel_form(self) -> tuple:
        """(qweight, scales, zeros) of gate_up and of down in kernels.fused_moe_w4a16's (q - zero) * scale form;
        mins become fp32 zero points (-min / scale)."""
        self._plain()

        def form(q, s, z, m):
            if m is not None:
                s, z = mins_as_zeros(s, m)
            return q, s, z
        return (*form(self.gu_q, self.gu_s, self.gu_z, self.gu_m), *form(self.dn_q, self.dn_s, self.dn_z, self.dn_m))

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 gate_up [E, 2I, H] and down [E, H, I] as the INT4 weights hold them (what tests compare with)."""

        self._plain()

        def one(q, s, z, m, e):
            if m is not None:
                return group_dequantize_mins(q[e], s[e], m[e], self.group_size)
            return group_dequantize_tensor(q[e], s[e], None if z is None else z[e], self.group_size)
        return (torch.stack([one(self.gu_q, self.gu_s, self.gu_z, self.gu_m, e) for e in range(self.num_experts)]),
                torch.stack([one(self.dn_q, self.dn_s, self.dn_z, self.dn_m, e) for e in range(self.num_experts)]))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.gu_x8 is not None and self.dn_x8 is not None:
            y = cpu_kernels.q4_1x8_moe(x.float().contiguous(), ids, weights.float().contiguous(), self.gu_x8,
                                       self.dn_x8, self.intermediate, self.residual_activations,
                                       self.second_pass_tau)
            return y.to(x.dtype)
        if self._kernel_args is None:   # with mins, fp32 zero points of every expert: not once per step
            self._kernel_args = self.kernel_form()
        w1q, w1s, w1z, w2q, w2s, w2z = self._kernel_args
        if kernel_takes(x):
            return kernels.fused_moe_w4a16(x, weights, ids, w1q, w1s, w1z, w2q, w2s, w2z, self.group_size)
        return kernels.fused_moe_w4a16_reference(x, weights, ids, w1q, w1s, w1z, w2q, w2s, w2z, self.group_size)


class SparseMoE(nn.Module):
    """Router + routed experts (+ a shared MLP): y = sum_k w_k * expert_k(x) + shared(x)."""

    def __init__(self, moe: MoEConfig, router: torch.Tensor, experts: DenseExperts | Int4Experts,
                 shared: nn.Module | None, correction_bias: torch.Tensor | None) -> None:
        super().__init__()
        self.moe = moe
        self.router = nn.Parameter(router.float(), requires_grad=False)      # [E, H], run in fp32 (as transformers)
        self.correction_bias = (nn.Parameter(correction_bias.float(), requires_grad=False)
                                if correction_bias is not None else None)
        self.experts = experts
        self.shared_experts = shared
        self.expert_range: tuple[int, int] | None = None   # expert parallelism: this rank holds experts [e0, e1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(x.float() @ self.router.t(), self.moe, self.correction_bias)
        if self.expert_range is not None:   # the other ranks' experts: id -1, weight 0 (their rows come back summed)
            e0, e1 = self.expert_range
            here = (ids >= e0) & (ids < e1)
            ids, weights = torch.where(here, ids - e0, -1), torch.where(here, weights, 0.0)
        y = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y

    def forward_cpu(self, x: torch.Tensor, ops) -> torch.Tensor:
        return self.forward(x)
