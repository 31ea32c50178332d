"""Where stage 1's encoders live on one device, within ``preprocess.vram_budget_gb``.

Resident (``offload_encoders = false``): every encoder on the device.  Offloaded: the text
towers (every component with token embeddings: Qwen2.5-VL's decoder, T5-XXL, umT5-XXL, CLIP)
are streamed block by block by the offload engine, and their token-embedding tables stay in
host memory, where the lookup runs (only the looked-up rows cross PCIe: umT5's table alone is
2.1 GB); the VAE's encoder stays on the device.  With a budget, what is left after the resident
pieces, the streaming slots and the VAE's activations keeps that many text blocks resident too; with
batches of prompts (``preprocess.batch_size``) fewer, when the room they leave lets one pass of the
streamed blocks serve more prompts (``blocks_room``).

The VAE's activations are estimated from the family's measured bytes per pixel
(``vae_encode_bytes``): a sample whose estimate exceeds 70 % of the budget is encoded in tiles
(``vae_tile``; the tile goes into the cache key, since tiling changes the latents), and pixel
and prompt batches are split so each call fits what the budget leaves (``prompt_encode_bytes``:
the family's activation bytes per prompt at its padded length).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from diffsynth_core.models import FamilySpec

GIB = 2**30
SAFETY = 1.25      # on the families' activation figures (allocator rounding, kernels' workspaces)
MARGIN = 256 * 2**20  # of the budget, kept free for what no figure covers (inputs, outputs, the allocator)
VAE_SHARE = 0.7    # at most this share of the budget goes to one VAE call before tiling kicks in
TILES = (1024, 768, 512, 384, 256)  # pixel tile sizes tried, largest first
FORCED_TILE = 512  # vae_tiling = true without a budget
BATCH_TOKENS = 512  # prompt length the budget's split plans batches for (the padded length of T5, Mistral)


class ExecutionDevice:
    """Where a streamed encoder computes, in the shape of accelerate's hooks: diffusers pipelines
    read ``module._hf_hook.execution_device`` (``get_module_execution_device``) to send inputs to
    the GPU rather than to the host memory the weights live in."""

    def __init__(self, device: torch.device):
        self.execution_device = device


class HostEmbedding(nn.Module):
    """An ``nn.Embedding`` whose table stays in host memory: the lookup runs on the CPU and only
    the looked-up rows travel to the device.  The table is a plain attribute, not a parameter,
    so nothing that moves parameters (``.to()``, the offload engine) ever copies it."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self.table = embedding.weight.detach()
        self.padding_idx = embedding.padding_idx

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(ids.cpu(), self.table, self.padding_idx)
        return rows.to(ids.device)


def module_bytes(module: nn.Module) -> int:
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def is_text_tower(module: nn.Module) -> bool:
    """A transformers model with token embeddings (what gets streamed when offloading)."""
    get = getattr(module, "get_input_embeddings", None)
    try:
        return isinstance(get() if get else None, nn.Embedding)
    except NotImplementedError:
        return False


def keep_embeddings_on_host(module: nn.Module) -> int:
    """Swap the token-embedding tables of a text tower (every embedding as wide as its vocabulary:
    T5 holds two, ``shared`` and ``encoder.embed_tokens``, tied or not) for ``HostEmbedding`` s;
    returns the bytes kept on the host."""
    vocab = module.get_input_embeddings().num_embeddings
    hosts: dict[int, HostEmbedding] = {}
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Embedding and child.num_embeddings == vocab and child.max_norm is None:
                setattr(parent, name, hosts.setdefault(id(child.weight), HostEmbedding(child)))
    return sum(h.table.numel() * h.table.element_size() for h in hosts.values())


def vae_tile(spec: FamilySpec, budget_gb: float, tiling, frames: int, height: int, width: int, *,
             exact_size: bool = True, itemsize: int = 2) -> int | None:
    """The tile (pixels per side) a sample is VAE-encoded with, or None for no tiling.

    A pure function of the config and the sample's size, so the cache key can record it.
    ``tiling`` is ``preprocess.vae_tiling``: False never tiles, True always does, "auto" tiles
    when one untiled encode would need more than 70 % of ``budget_gb``.  The VAE cuts tiles when
    the height or the width exceeds the tile; with ``exact_size`` (a still image of known size) a
    tile that would cut nothing is None, while for a size bound (videos, known only after
    decoding) the tile is the setting the sample is encoded with.  ``itemsize``: bytes per
    element of the VAE's dtype (the family's figures are for bf16).
    """
    if tiling is False or spec.vae_encode_bytes is None:
        return None
    allowed = budget_gb * GIB * VAE_SHARE if budget_gb else math.inf
    if tiling == "auto" and _vae_bytes(spec, frames, height, width, itemsize) <= allowed:
        return None
    fitting = [t for t in TILES if _vae_bytes(spec, frames, min(height, t), min(width, t), itemsize) <= allowed]
    tile = FORCED_TILE if not budget_gb else (fitting[0] if fitting else TILES[-1])
    if exact_size and max(height, width) <= tile:
        return None
    return tile


def _prompt_bytes(spec: FamilySpec, tokens: int, itemsize: int = 2) -> float:
    return spec.prompt_encode_bytes(tokens) * SAFETY * itemsize / 2


def _vae_bytes(spec: FamilySpec, frames: int, height: int, width: int, itemsize: int = 2) -> float:
    return spec.vae_encode_bytes(frames, height, width) * SAFETY * itemsize / 2


@dataclass
class Placement:
    """Encoders placed on ``device``: the offload managers to detach at the end, and how many
    bytes of activations one VAE or text-encoder call may use (None: no limit)."""

    device: torch.device
    itemsize: int = 2  # of the encoders' dtype
    managers: list = field(default_factory=list)
    activation_bytes_allowed: float | None = None
    report: dict = field(default_factory=dict)

    def pixels_per_call(self, spec: FamilySpec, frames: int, height: int, width: int, tile: int | None) -> int:
        """How many samples of this shape one VAE call may take (at least one)."""
        if self.activation_bytes_allowed is None or spec.vae_encode_bytes is None:
            return 1 << 30
        h, w = (min(height, tile), min(width, tile)) if tile else (height, width)
        return max(1, int(self.activation_bytes_allowed // _vae_bytes(spec, frames, h, w, self.itemsize)))

    def prompt_chunks(self, spec: FamilySpec, lengths: list[int]) -> list[tuple[int, int]]:
        """(start, stop) of consecutive prompts one text-encoder call may take, given the tokens
        each takes (a call pads to its longest); at least one prompt per call."""
        if self.activation_bytes_allowed is None or spec.prompt_encode_bytes is None:
            return [(0, len(lengths))]
        chunks, start, longest = [], 0, 0
        for i, tokens in enumerate(lengths):
            longest = max(longest, tokens)
            if i > start and (i + 1 - start) * self._prompt_bytes(spec, longest) > self.activation_bytes_allowed:
                chunks.append((start, i))
                start, longest = i, tokens
        return chunks + [(start, len(lengths))]

    def _prompt_bytes(self, spec: FamilySpec, tokens: int) -> float:
        return _prompt_bytes(spec, tokens, self.itemsize)

    def close(self) -> None:
        for manager in self.managers:
            manager.detach()
        self.managers.clear()


def place_encoders(components: dict, spec: FamilySpec, device: torch.device, stream: bool,
                   budget_gb: float, tiling, largest_sample: tuple[int, int, int], itemsize: int,
                   batch_size: int = 1) -> Placement:
    """Put ``components`` on ``device``: resident, or streamed (see the module doc).

    ``largest_sample`` = (frames, height, width) bounding the samples the config allows: the VAE's
    reserve when splitting the budget between text blocks and VAE activations.  ``batch_size``:
    prompts a call is given (``preprocess.batch_size``), which decides how the budget is split
    between resident text blocks and activations (``blocks_room``).
    """
    from diffsynth_core.offload import OffloadTrainingManager

    modules = {n: c for n, c in components.items() if isinstance(c, nn.Module)}
    for module in modules.values():
        module.eval().requires_grad_(False)  # frozen: the engine streams only frozen weights
    streamed = {n: m for n, m in modules.items() if stream and is_text_tower(m)}
    placement = Placement(device, itemsize)
    resident = 0
    for name, module in modules.items():
        if name not in streamed:
            module.to(device)
            resident += module_bytes(module)
    host_tables = sum(keep_embeddings_on_host(m) for m in streamed.values())
    for module in streamed.values():
        module._hf_hook = ExecutionDevice(device)
    budget = max(budget_gb * GIB - MARGIN, 0.0) if budget_gb else None
    vae_reserve = _vae_reserve(spec, budget_gb, tiling, largest_sample, itemsize)
    for module in streamed.values():
        largest, outside, blocks = _block_sizes(module)
        floor = 2 * largest + outside  # two slots (prefetch 1) and what stays outside the blocks
        blocks_gb = 0.0
        if budget is not None:
            room = max(0.0, budget - resident - floor - vae_reserve)
            per_prompt = _prompt_bytes(spec, BATCH_TOKENS, itemsize) if spec.prompt_encode_bytes else None
            blocks_gb = blocks_room(room, largest, blocks, vae_reserve, per_prompt, batch_size) / GIB
        manager = OffloadTrainingManager(module, device, resident_gb=blocks_gb, data_parallel=False,
                                         share_host_copy=False)  # per process: no collectives
        placement.managers.append(manager)
        info = manager.report()  # resident for good: all but the streamed units, plus the slots
        resident += module_bytes(module) - info["streamed_bytes"] + info["slots"] * largest
    if budget is not None:
        placement.activation_bytes_allowed = max(budget - resident, 0)
    frames, height, width = largest_sample
    placement.report = {"resident_bytes": resident, "host_embedding_bytes": host_tables,
                        "streamed": sorted(streamed), "activation_bytes_allowed": placement.activation_bytes_allowed,
                        "text_blocks_resident": sum(m.report()["budget_units"] for m in placement.managers),
                        "prompts_per_call_at_512_tokens": len(range(*placement.prompt_chunks(spec, [512] * 64)[0])),
                        "largest_samples_per_vae_call": placement.pixels_per_call(spec, frames, height, width, None)}
    return placement


def blocks_room(room: float, block: int, blocks: int, vae_reserve: float, prompt_bytes: float | None,
                batch_size: int) -> float:
    """Of ``room`` (the budget less everything else and the VAE's reserve), the bytes kept for
    resident text blocks.  One block more resident saves its copy on every call; one block's bytes
    more of activations let a call take more prompts, and a batch of prompts shares one pass of the
    streamed blocks.  So: the resident count with the fewest streamed block bytes per prompt at
    ``batch_size`` prompts a call (the most blocks among equals; a batch of one keeps all that fit).
    Text and VAE calls never run at once: the VAE's reserve is prompt room too."""
    fit = min(blocks, int(room // block)) if block else 0
    if batch_size <= 1 or not prompt_bytes or not fit:
        return room
    best_cost, best = math.inf, fit
    for kept in range(fit + 1):
        per_call = min(batch_size, max(1, int((room - kept * block + vae_reserve) // prompt_bytes)))
        cost = (blocks - kept) / per_call
        if cost <= best_cost:
            best_cost, best = cost, kept
    return best * block if best < fit else room


def _vae_reserve(spec: FamilySpec, budget_gb: float, tiling, largest_sample: tuple[int, int, int],
                 itemsize: int) -> float:
    """VAE activation bytes kept free for one call on the largest sample (tiled if it will be)."""
    if not budget_gb or spec.vae_encode_bytes is None:
        return 0.0
    frames, height, width = largest_sample
    tile = vae_tile(spec, budget_gb, tiling, frames, height, width, exact_size=False, itemsize=itemsize)
    return _vae_bytes(spec, frames, min(height, tile or height), min(width, tile or width), itemsize)


def _block_sizes(module: nn.Module) -> tuple[int, int, int]:
    """(bytes of the largest block, bytes outside the blocks, blocks) of a module the engine streams."""
    from diffsynth_core.offload.units import find_block_containers

    blocks = [b for _, cont in find_block_containers(module, None) for b in cont.children()]
    sizes = [module_bytes(b) for b in blocks]
    return max(sizes, default=0), module_bytes(module) - sum(sizes), len(blocks)
