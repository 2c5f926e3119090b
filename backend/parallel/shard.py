"""Cut a loaded (not yet prepacked) model into rank r's shard of a tensor-parallel group of `world` ranks.

- Attention (GQA): the q, k and v heads are split by rank (column-parallel qkv: rank r keeps heads
  [r H/N, (r+1) H/N) and KV heads likewise, so its KV pool holds its KV heads only); o_proj is row-parallel (the
  same heads' input columns) and its output all-reduced.
- Dense MLPs and shared experts: gate/up column-parallel (rows [r I/N, (r+1) I/N) of gate and of up), down
  row-parallel; one all-reduce per MLP.
- Routed experts: split by expert (`expert_parallel`: rank r holds experts [r E/N, (r+1) E/N), the router stays
  whole, pairs routed elsewhere are skipped) or, without it, each expert's width split as an MLP's; the routed and
  the shared part are summed before the MoE block's one all-reduce.
- Embedding and head: vocab-parallel (rows [r V/N, (r+1) V/N)): the lookup zeroes the ids another rank holds and
  all-reduces; the head's logits are all-gathered.
INT4 weights stay INT4 per shard: W4A16Linear / Int4Experts tensors are sliced by rows (outputs) or by whole
quantization groups along K (inputs), never re-rounded; a GGUF Q8_0 embedding is split by rows and its tied head re-tied to the rank's rows at prepack. MLA
attention is not split yet (refused by name).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from edgeinfer.backend.model.decoder import DecoderModel
from edgeinfer.backend.model.layers import MLP, Attention
from edgeinfer.backend.model.linear import DenseLinear, Q8Embedding, W4A16Linear
from edgeinfer.backend.model.mla import MLAAttention
from edgeinfer.backend.model.model_config import ModelConfig
from edgeinfer.backend.model.moe import DenseExperts, Int4Experts, SparseMoE
from edgeinfer.backend.parallel.comm import Comm


class ParallelError(ValueError):
    pass


def local_config(cfg: ModelConfig, world: int, expert_parallel: bool = False) -> ModelConfig:
    """This rank's view: heads, KV heads and widths divided by world (vocab and hidden stay whole)."""
    if cfg.mla is not None:
        raise ParallelError(f"{cfg.architecture}: --tensor-parallel with MLA attention is not implemented yet; "
                            "serve it with --tensor-parallel 1")
    for name, v in (("num_attention_heads", cfg.num_heads), ("num_key_value_heads", cfg.num_kv_heads),
                    ("intermediate_size", cfg.intermediate_size), ("vocab_size", cfg.vocab_size)):
        if v % world:
            raise ParallelError(f"--tensor-parallel {world}: {name}={v} is not divisible by {world}")
    moe = cfg.moe
    if moe is not None:
        if expert_parallel and moe.num_experts % world:
            raise ParallelError(f"--expert-parallel over {world} ranks: num_experts={moe.num_experts} is not "
                                f"divisible by {world}")
        if not expert_parallel and moe.intermediate_size % world:
            raise ParallelError(f"--tensor-parallel {world}: moe_intermediate_size={moe.intermediate_size} is not "
                                f"divisible by {world} (or pass --expert-parallel)")
        moe = dataclasses.replace(moe, intermediate_size=(moe.intermediate_size if expert_parallel
                                                          else moe.intermediate_size // world))
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // world, num_kv_heads=cfg.num_kv_heads // world,
                               intermediate_size=cfg.intermediate_size // world, moe=moe)


class AllReduce(nn.Module):
    """A row-parallel block: its partial output summed over the ranks."""

    def __init__(self, inner: nn.Module, comm: Comm) -> None:
        super().__init__()
        self.inner, self.comm = inner, comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(self.inner(x))

    def forward_cpu(self, x: torch.Tensor, ops) -> torch.Tensor:
        fn = getattr(self.inner, "forward_cpu", None)
        return self.comm.all_reduce(fn(x, ops) if fn is not None else self.inner(x))


# ---- slicing linears (before prepack): rows = output features, cols = input features in whole groups
def rows(linear: nn.Module, idx: torch.Tensor) -> nn.Module:
    if isinstance(linear, DenseLinear):
        assert linear.weight is not None, "shard before prepack"
        return DenseLinear(linear.weight.data[idx].contiguous(),
                           None if linear.bias is None else linear.bias.data[idx].contiguous())
    if isinstance(linear, W4A16Linear):
        def pick(t):
            return None if t is None else t[idx].contiguous()
        return W4A16Linear(pick(linear.qweight), pick(linear.scales), pick(linear.zeros), linear.group_size,
                           None if linear.bias is None else linear.bias.data[idx].contiguous(),
                           compute_dtype=linear.compute_dtype, mins=pick(linear.mins))
    raise ParallelError(f"cannot split a {type(linear).__name__} by rows")


def cols(linear: nn.Module, k0: int, k1: int, keep_bias: bool) -> nn.Module:
    if isinstance(linear, DenseLinear):
        assert linear.weight is not None, "shard before prepack"
        bias = linear.bias.data.clone() if (linear.bias is not None and keep_bias) else None
        return DenseLinear(linear.weight.data[:, k0:k1].contiguous(), bias)
    if isinstance(linear, W4A16Linear):
        g = linear.group_size
        if k0 % g or k1 % g:
            raise ParallelError(f"a row-parallel INT4 linear splits along K in whole groups of {g}: "
                                f"columns {k0}..{k1} do not")

        def pick(t):
            return None if t is None else t[:, k0 // g:k1 // g].contiguous()
        bias = linear.bias.data.clone() if (linear.bias is not None and keep_bias) else None
        return W4A16Linear(linear.qweight[:, k0 // 2:k1 // 2].contiguous(), pick(linear.scales), pick(linear.zeros),
                           g, bias, compute_dtype=linear.compute_dtype, mins=pick(linear.mins))
    raise ParallelError(f"cannot split a {type(linear).__name__} by columns")


def _span(n: int, rank: int, world: int) -> tuple[int, int]:
    return rank * n // world, (rank + 1) * n // world


def _gate_up_rows(inter: int, rank: int, world: int) -> torch.Tensor:
    a, b = _span(inter, rank, world)
    return torch.cat((torch.arange(a, b), inter + torch.arange(a, b)))


def _shard_mlp(mlp: MLP, inter: int, rank: int, world: int) -> MLP:
    if mlp.gate_up_proj is None:
        raise ParallelError("load the model with fuse_gate_up=True to shard it")
    a, b = _span(inter, rank, world)
    return MLP(rows(mlp.gate_up_proj, _gate_up_rows(inter, rank, world)), cols(mlp.down_proj, a, b, rank == 0))


def _shard_experts(experts: DenseExperts | Int4Experts, rank: int, world: int, expert_parallel: bool
                   ) -> DenseExperts | Int4Experts:
    e = experts.num_experts
    if isinstance(experts, DenseExperts):
        if expert_parallel:
            a, b = _span(e, rank, world)
            return DenseExperts(experts.gate_up.data[a:b].contiguous(), experts.down.data[a:b].contiguous())
        inter = experts.down.shape[2]
        a, b = _span(inter, rank, world)
        return DenseExperts(experts.gate_up.data[:, _gate_up_rows(inter, rank, world)].contiguous(),
                            experts.down.data[:, :, a:b].contiguous())
    if experts.prepacked:
        raise ParallelError("shard the experts before prepack")
    gu = (experts.gu_q, experts.gu_s, experts.gu_z, experts.gu_m)
    dn = (experts.dn_q, experts.dn_s, experts.dn_z, experts.dn_m)
    if expert_parallel:
        a, b = _span(e, rank, world)
        pick = [None if t is None else t[a:b].contiguous() for t in (*gu, *dn)]
        return Int4Experts(tuple(pick[:4]), tuple(pick[4:]), experts.group_size)
    inter, g = experts.intermediate, experts.group_size
    a, b = _span(inter, rank, world)
    if a % g or b % g:
        raise ParallelError(f"the experts' width {inter} splits over {world} ranks in whole groups of {g} only if "
                            f"{inter // world} is a multiple of {g} (or pass --expert-parallel)")
    idx = _gate_up_rows(inter, rank, world)
    gu_s = tuple(None if t is None else t[:, idx].contiguous() for t in gu)
    dn_s = (dn[0][:, :, a // 2:b // 2].contiguous(),
            *(None if t is None else t[:, :, a // g:b // g].contiguous() for t in dn[1:]))
    return Int4Experts(gu_s, dn_s, g)


def shard_model(model: DecoderModel, comm: Comm, expert_parallel: bool = False) -> DecoderModel:
    """In place: `model` becomes rank comm.rank's shard (see the module docstring). Returns it."""
    rank, world = comm.rank, comm.world
    cfg = model.cfg
    local = local_config(cfg, world, expert_parallel)
    model.cfg = local
    q, kv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qa, qb = _span(q, rank, world)
    ka, kb = _span(kv, rank, world)
    qkv_rows = torch.cat((torch.arange(qa * hd, qb * hd), q * hd + torch.arange(ka * hd, kb * hd),
                          (q + kv) * hd + torch.arange(ka * hd, kb * hd)))
    for layer in model.layers:
        attn = layer.self_attn
        if isinstance(attn, MLAAttention):
            raise ParallelError("MLA attention is not split yet")
        assert isinstance(attn, Attention)
        attn.cfg = local
        attn.qkv_proj = rows(attn.qkv_proj, qkv_rows)
        attn.o_proj = AllReduce(cols(attn.o_proj, qa * hd, qb * hd, rank == 0), comm)
        mlp = layer.mlp
        if isinstance(mlp, SparseMoE):
            mlp.moe = local.moe  # type: ignore[assignment]
            mlp.experts = _shard_experts(mlp.experts, rank, world, expert_parallel)
            if expert_parallel:
                mlp.expert_range = _span(cfg.moe.num_experts, rank, world)  # type: ignore[union-attr]
            shared = mlp.shared_experts
            if isinstance(shared, MLP):
                mlp.shared_experts = _shard_mlp(shared, cfg.moe.intermediate_size * cfg.moe.n_shared_experts,  # type: ignore
                                                rank, world)
            layer.mlp = AllReduce(mlp, comm)  # type: ignore[assignment]
        else:
            layer.mlp = AllReduce(_shard_mlp(mlp, cfg.intermediate_size, rank, world), comm)  # type: ignore
    va, vb = _span(cfg.vocab_size, rank, world)
    embed = model.embed_tokens
    head = model.lm_head_linear
    head_w = head.weight.data if isinstance(head, DenseLinear) and head.weight is not None else None
    if head_w is None:
        raise ParallelError(f"cannot split a {type(head).__name__} head")
    if isinstance(embed, Q8Embedding):   # a GGUF Q8_0 table: its rows, int8 + scales (prepack ties the head to it)
        if embed.interleaved:
            raise ParallelError("shard the Q8_0 embedding before prepack")
        model.embed_tokens = Q8Embedding(embed.qweight[va:vb].contiguous(), embed.scales[va:vb].contiguous(),
                                         embed.dtype)
    else:
        model.embed_tokens = nn.Parameter(embed.data[va:vb].contiguous(), requires_grad=False)
        model.tied_lm_head = False
    model.lm_head_linear = DenseLinear(head_w[va:vb].contiguous())
    model.parallel = comm  # type: ignore[assignment]
    model.vocab_range = (va, vb)
    return model
