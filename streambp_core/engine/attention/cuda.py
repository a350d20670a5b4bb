"""The CUDA kernels behind `prefix_attention`: flash-attn when it is importable and can take the inputs,
torch SDPA otherwise. Every function here also runs on CPU tensors (the tests drive them there, with a
stand-in `flash_attn` module), so only the kernels themselves need a GPU.

Kernel choice (`choose_kernel`), the same for every method because all of them attend through here:
- `sdpa`: torch SDPA. Unpadded: torch's lower-right causal bias, which keeps SDPA on its flash kernel;
  a square chunk (c = e: the first chunk of a layer, or the whole sequence in one chunk as the automatic
  partitions choose on a large GPU) in float16/bfloat16 instead takes `is_causal=True`, the same mask
  (lower-right and top-left coincide), so SDPA dispatches as for any model's causal attention and may
  pick a faster kernel: on an H200 the cuDNN kernel it picks for square causal attention took 139 ms of
  attention backward at 16k tokens (Qwen3-1.7B) against 219 ms in the lower-right bias's flash kernel
  (`results/gpu/README.md`). Padded or banded (sliding window): a boolean (B, 1, c, e) mask, K/V expanded
  to the query heads (the masked kernels take no GQA).
- `flash`: flash-attn. Unpadded: `flash_attn_func(causal=True)`, whose causal mask is aligned to the end
  of the keys when there are fewer queries than keys. Padded: `flash_attn_varlen_func` on the packed
  real tokens (below). flash-attn takes float16/bfloat16 only.
- `auto`: flash when flash-attn is importable and takes the inputs, else sdpa.
- Whatever the backend, an unpadded half-precision chunk whose prefix is longer than
  `blocked_attention.BLOCKED_MIN_KEYS` (and not square) takes `BlockedFlashAttention`: torch's
  FlashAttention-2 with a backward over tiles of keys, whose buffers do not grow with the prefix
  (`blocked_applies`); below that the kernels above, faster there, and their buffers are small.
- Attention sinks (gpt-oss, `attention.sinks`): flash-attn's and SDPA's kernels take none, so a chunk with
  sinks never reaches them: unpadded and in half precision it takes `BlockedFlashAttention` with the sinks
  folded into its log-sum-exp (`sink_blocked_applies`, whatever the prefix), otherwise the exact math of
  the engine's own op (`prefix.py`).
- A soft-capped chunk (Gemma 2's `attn_logit_softcapping`): flash-attn 2.6 or later, which caps inside
  its kernel (`softcap=`), when it is chosen and takes the inputs; otherwise the engine's exact custom ops
  (`prefix.math_attention`, 'softcap-math'), since neither SDPA, torch's flash kernel behind the blocked
  backward, nor an older flash-attn has a cap.
`plan_kernel` names the path a chunk takes; the simulator sizes each path's own buffers from it
(`kernel_workspace.py`). A simulation plans the GPU run its `attn` asks for, whatever is installed where it
runs: `flash` as flash-attn 2.6 or later, `auto` and `sdpa` as torch SDPA (`softcap_charge` says which
a soft-capped chunk is charged as).
Whenever the choice is not flash-attn although flash-attn was asked for (or `auto` finds it missing),
a warning says why; Python shows each such warning once per process.

Varlen packing of a padded chunk (queries = the last c of e positions, `key_valid` (B, e)):
1. keep the real keys of each row, in order: (sum of real keys, Hkv, hd), cu_seqlens_k from their counts;
2. keep the real queries likewise: (sum of real queries, H, hd), cu_seqlens_q;
3. flash-attn's causal varlen aligns each row's queries to the end of its keys: the j-th real query of a
   row whose chunk starts after n real keys sees the first n + j + 1 real keys, exactly the real keys at
   or before its position, whatever the padding pattern (right, left, or holes). A sliding window
   (`window_size=(window - 1, 0)`) counts packed keys, which equals counting positions only when each row's
   real tokens are contiguous (right or left padding); a row with holes under a window goes to SDPA;
4. scatter the outputs back to (B, H, c, hd); a padding query row outputs zeros, as transformers'
   flash-attention path gives padding positions. Real positions never attend to padding ones, so this
   changes nothing a loss that ignores padding positions can see.
"""

from __future__ import annotations

import importlib.util
import re
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right
from torch.utils._python_dispatch import _disable_current_modes

from streambp_core.engine.attention import blocked
from streambp_core.engine.chunks import allowed_mask

FLASH_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
"""Input precisions flash-attn accepts."""
FLASH_MAX_HEAD_DIM = 256
"""Largest head dimension flash-attn 2 supports."""
FLASH_SOFTCAP_RELEASE = (2, 6)
"""The first flash-attn release whose kernels take `softcap=` (Gemma 2's attention logit soft-cap)."""


def flash_attn_available() -> bool:
    """True when the optional flash-attn package is importable."""
    return importlib.util.find_spec("flash_attn") is not None


def flash_softcap_available() -> bool:
    """True when the installed flash-attn caps scores inside its kernel (`FLASH_SOFTCAP_RELEASE` or later)."""
    if not flash_attn_available():
        return False
    import flash_attn

    release = re.match(r"(\d+)\.(\d+)", getattr(flash_attn, "__version__", ""))
    return release is not None and tuple(map(int, release.groups())) >= FLASH_SOFTCAP_RELEASE


def softcap_charge(backend: str) -> str:
    """What a simulated soft-capped chunk's backward is charged as under `backend` (`plan_kernel`), in
    words: flash-attn's own buffers when `flash` is asked for, else the custom ops' score-sized ones."""
    if backend == "flash":
        return "flash-attn >= 2.6's buffers (it applies the soft-cap in its kernel)"
    return (f"the engine's exact custom ops' score-sized buffers (attn {backend} runs torch SDPA on the GPU, "
            "which has no soft-cap; --attn flash charges flash-attn >= 2.6's)")


def choose_kernel(backend: str, q: Tensor, warn: bool = True) -> str:
    """'flash' or 'sdpa' for queries `q` under the requested `backend` (auto, sdpa, flash); `warn` False
    keeps quiet about a flash-attn that cannot take them."""
    if backend == "sdpa":
        return "sdpa"
    reason = _flash_unusable(q)
    if reason is None:
        return "flash"
    if warn:
        warnings.warn(f"attention: {reason}; using torch SDPA (attn={backend})", stacklevel=2)
    return "sdpa"


def blocked_applies(q: Tensor, k: Tensor, key_valid: Tensor | None) -> bool:
    """Whether `cuda_attention` takes `BlockedFlashAttention`: an unpadded chunk with fewer queries than
    keys, more than `BLOCKED_MIN_KEYS` keys, in a precision and head size torch's flash kernel takes, on
    a GPU it runs on (compute capability 8.0 or later)."""
    head_dim = q.shape[-1]
    return (key_valid is None and q.shape[2] < k.shape[2] and k.shape[2] > blocked.BLOCKED_MIN_KEYS
            and q.dtype in FLASH_DTYPES and head_dim <= FLASH_MAX_HEAD_DIM and head_dim % 8 == 0
            and (q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] >= 8))


def sink_blocked_applies(q: Tensor, key_valid: Tensor | None) -> bool:
    """Whether a chunk with attention sinks takes `BlockedFlashAttention` (sinks folded in): unpadded, in a
    precision and head size torch's flash kernel takes, on a GPU it runs on; any prefix length."""
    head_dim = q.shape[-1]
    flash_gpu = q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] >= 8
    return (key_valid is None and q.dtype in FLASH_DTYPES and head_dim <= FLASH_MAX_HEAD_DIM
            and head_dim % 8 == 0 and flash_gpu)


def plan_kernel(backend: str, q: Tensor, k: Tensor, key_valid: Tensor | None, window: int | None,
                simulated: bool = False, blocking: bool = True, sinks: Tensor | None = None,
                softcap: float | None = None) -> str:
    """The path `cuda_attention` takes for this chunk: 'blocked' (`BlockedFlashAttention`), 'flash' or
    'flash-varlen' (flash-attn), 'sdpa-cudnn' (a square half-precision chunk: SDPA's own causal
    dispatch, cuDNN on Hopper GPUs), 'sdpa-flash' (torch's lower-right bias: its FlashAttention-2 kernel
    in half precision), 'sdpa-masked' (a boolean mask: K/V expanded, the memory-efficient kernel) or
    'sdpa-other' (SDPA outside half precision).

    `simulated` (meta tensors, the simulator): `auto` means sdpa, the kernels every torch build has, so a
    simulation does not depend on whether flash-attn is installed where it runs; padding is taken to
    leave each row's real tokens contiguous (a meta mask has no values); no warning. `blocking` False:
    never 'blocked'. With `sinks`: 'blocked' (`sink_blocked_applies`) or 'sinks-math' (the engine op's
    exact math: the chunk's scores held whole). `softcap`: a soft-capped chunk, flash-attn's or else
    'softcap-math' (the custom ops with the chunk's score matrix).
    """
    if sinks is not None:
        capped = softcap is not None
        return "blocked" if blocking and not capped and sink_blocked_applies(q, key_valid) else "sinks-math"
    if blocking and softcap is None and blocked_applies(q, k, key_valid):
        return "blocked"
    packs = simulated or _band_packs(key_valid, window, backend)
    if _takes_flash(backend, q, simulated, softcap) and packs:
        return "flash" if key_valid is None else "flash-varlen"
    if softcap is not None:
        return "softcap-math"
    if key_valid is not None or window is not None:
        return "sdpa-masked"
    if q.dtype not in FLASH_DTYPES:
        return "sdpa-other"
    return "sdpa-cudnn" if q.shape[2] == k.shape[2] else "sdpa-flash"


def _takes_flash(backend: str, q: Tensor, simulated: bool, softcap: float | None) -> bool:
    """Whether flash-attn runs a chunk of queries `q`: simulated, when `flash` is asked for and it takes q's
    precision and head size (flash-attn 2.6 or later taken as installed); on a GPU, when `choose_kernel`
    picks it and, for a soft-capped chunk, it caps in its kernel (`flash_softcap_available`)."""
    if simulated:
        return backend == "flash" and _flash_unusable(q, installed=True) is None
    if choose_kernel(backend, q) != "flash":
        return False
    return softcap is None or flash_softcap_available()


def _flash_unusable(q: Tensor, installed: bool = False) -> str | None:
    """Why flash-attn cannot take `q` here, or None when it can; `installed`: take it as installed."""
    if not installed and not flash_attn_available():
        return "flash-attn is not importable (pip install 'streambp-bench[cuda]')"
    if q.dtype not in FLASH_DTYPES:
        return f"flash-attn takes float16/bfloat16, not {str(q.dtype).removeprefix('torch.')}"
    if q.shape[-1] > FLASH_MAX_HEAD_DIM or q.shape[-1] % 8:
        return f"flash-attn takes head dimensions that are multiples of 8 up to 256, not {q.shape[-1]}"
    return None


def cuda_attention(q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor | None, scale: float,
                   backend: str, window: int | None = None, blocking: bool = True,
                   softcap: float | None = None) -> Tensor:
    """`prefix_attention` on CUDA: (B, H, c, hd) queries against (B, Hkv, e, hd) keys/values; `window`
    narrows each query to itself and the window - 1 keys before it; `blocking` False: never the blocked
    backward; `softcap` caps the scores (flash-attn's, else the exact custom ops: module docstring)."""
    if blocking and softcap is None and blocked_applies(q, k, key_valid):
        return blocked.BlockedFlashAttention.apply(q, k, v, scale, window, blocked.BLOCK_TOKENS)
    if choose_kernel(backend, q) == "flash" and _band_packs(key_valid, window, backend):
        if key_valid is None:
            return flash_attention(q, k, v, scale, window, softcap)
        return flash_varlen_attention(q, k, v, key_valid, scale, window, softcap)
    refuse_uncapped(softcap)
    return sdpa_attention(q, k, v, key_valid, scale, window)


def flash_caps(backend: str, q: Tensor, key_valid: Tensor | None, window: int | None) -> bool:
    """Whether flash-attn takes this chunk and can cap its scores: chosen, 2.6 or later, and for a padded
    chunk under a window, the band packs (`_band_packs`); a packed rows' (B, c, e) mask always packs. A
    soft-capped chunk it does not take runs the engine's exact custom ops (`prefix.math_attention`)."""
    if choose_kernel(backend, q, warn=False) != "flash" or not flash_softcap_available():
        return False
    return key_valid is None or key_valid.dim() == 3 or _band_packs(key_valid, window, backend)


def refuse_uncapped(softcap: float | None) -> None:
    """ValueError for a soft-cap on a kernel without one (SDPA): never silently uncapped scores."""
    if softcap is not None:
        raise ValueError("torch SDPA has no attention logit soft-cap: a soft-capped chunk runs flash-attn "
                         "or the engine's custom ops (prefix_attention chooses)")


def _band_packs(key_valid: Tensor | None, window: int | None, backend: str) -> bool:
    """Whether packing real tokens keeps a sliding window's band: no window, no padding, or every row's real
    tokens contiguous. Otherwise warns (once) that SDPA takes the chunk."""
    if window is None or key_valid is None:
        return True
    positions = torch.arange(key_valid.shape[1], device=key_valid.device)
    first = torch.where(key_valid, positions, key_valid.shape[1]).amin(dim=1)
    last = torch.where(key_valid, positions, -1).amax(dim=1)
    count = key_valid.sum(dim=1)
    if bool(((count == 0) | (last - first + 1 == count)).all()):
        return True
    warnings.warn(f"attention: a sliding window over padding with holes; using torch SDPA (attn={backend})",
                  stacklevel=3)
    return False


def _window_kwargs(window: int | None, softcap: float | None = None) -> dict:
    """flash-attn's band argument: (left, right) keys around the diagonal; none for a full prefix; and its
    `softcap` when the scores are capped."""
    band = {} if window is None else {"window_size": (window - 1, 0)}
    return band if softcap is None else {**band, "softcap": softcap}


def flash_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, window: int | None = None,
                    softcap: float | None = None) -> Tensor:
    """flash-attn on an unpadded chunk; its causal mask (and band) is lower-right when c < e."""
    from flash_attn import flash_attn_func

    out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),  # (B, c, H, hd)
                          softmax_scale=scale, causal=True, **_window_kwargs(window, softcap))
    return out.transpose(1, 2)


def flash_varlen_attention(q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor, scale: float,
                           window: int | None = None, softcap: float | None = None) -> Tensor:
    """flash-attn's varlen kernel on the real tokens of a padded chunk (module docstring, steps 1-4)."""
    from flash_attn import flash_attn_varlen_func

    b, h, c, hd = q.shape
    query_valid = key_valid[:, -c:]
    packed_q, cu_q, max_q = _pack(q.transpose(1, 2), query_valid)  # (nq, H, hd)
    packed_k, cu_k, max_k = _pack(k.transpose(1, 2), key_valid)  # (nk, Hkv, hd)
    packed_v = v.transpose(1, 2)[key_valid]
    packed_out = flash_attn_varlen_func(packed_q, packed_k, packed_v, cu_q, cu_k, max_q, max_k,
                                        softmax_scale=scale, causal=True, **_window_kwargs(window, softcap))
    out = q.new_zeros(b, c, h, hd).index_put((query_valid,), packed_out)
    return out.transpose(1, 2)


def _pack(x: Tensor, valid: Tensor) -> tuple[Tensor, Tensor, int]:
    """Rows (B, n, heads, hd) -> their valid positions packed (sum valid, heads, hd), int32 cumulative
    lengths (B + 1,), longest row."""
    lengths = valid.sum(dim=1, dtype=torch.int32)
    cu_seqlens = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    return x[valid], cu_seqlens, int(lengths.max())


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor | None, scale: float,
                   window: int | None = None) -> Tensor:
    """torch SDPA: the lower-right bias when unpadded and unbanded, else a boolean mask with K/V expanded."""
    gqa = q.shape[1] != k.shape[1]
    if key_valid is None and window is None:
        if q.shape[2] == k.shape[2] and q.dtype in FLASH_DTYPES:  # square: SDPA's own causal dispatch
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        bias = lower_right_bias(q.shape[2], k.shape[2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=gqa)
    mask = allowed_mask(q.shape[2], key_valid, k.shape[2], window)[:, None]
    if gqa:  # SDPA's masked CUDA kernels do not take GQA: expand K/V to the query heads.
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def lower_right_bias(num_queries: int, num_keys: int):
    """torch's lower-right causal bias. It is a tensor subclass, built with dispatch modes (a memory
    tracker) suspended: a mode that has already wrapped the raw tensor would make its construction fail."""
    with _disable_current_modes():
        return causal_lower_right(num_queries, num_keys)
