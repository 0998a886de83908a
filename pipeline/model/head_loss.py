"""The training objective's LM heads and losses in one fused, chunked function (docs/design.md §7).

    loss = CE(hf W^T, y) + lambda_short * CE(hs W^T, y) + lambda_align * mean((hs W^T - sg(hf W^T))^2)

hf, hs (B, T, d): the final-normed states of the full and the shortcut pass; W (V, d) the LM head. The plain path
materialises both (B, T, V) logits, and autograd keeps them (the MSE's inputs) and both log-softmax outputs for
backward: four (B, T, V) fp32 tensors. Here the rows (tokens) are taken a chunk at a time: the chunk's logits of
both passes, the losses and their gradients w.r.t. the logits in closed form

    dCE/dlogits   = (softmax - onehot(y)) / N      N = #{y != -1} over the whole batch (a device tensor)
    dMSE/dlogits_s = 2 (logits_s - logits_f) / (B T V)        (nothing flows into logits_f: stop-gradient)

then grad_hf = glogits_f W, grad_hs = glogits_s W, grad_W += glogits_f^T hf + glogits_s^T hs. Only grad_hf,
grad_hs (B, T, d) and grad_W (V, d) are kept for backward, which scales them by the incoming gradient: no
(B, T, V) tensor outlives a chunk. Chunk rows: `rows_per_chunk`, the chunk's fp32 logits of one pass within
CHUNK_BYTES on CPU, GPU_CHUNK_BYTES on a GPU (and on the meta device `tlf plan` traces for one), at least MIN_ROWS
rows; a few such buffers are live at once. Each chunk reads W and adds into grad_W (V, d) once per pass, so on a
GPU thin chunks cost more than their matmuls: at the paper's scale 41-row chunks (8 MiB) made that add 1/3 of a
step on an H200 (bench/README `## plan_check`).

With per-token weights w (B, T) (the expected router recipe's pi_d at one exit) the full pass's term is
sum_tau w_tau CE_tau / N instead: the logits' gradient is scaled by w row by row, and w gets CE_tau / N (each
row's cross-entropy, kept for backward: (B, T) floats). The reported loss_L stays the unweighted mean.

Precision: matmuls in the autocast dtype under autocast (else the inputs' dtype), softmax and losses in fp32
(the alignment's sum of squares in fp64), grad_W summed over chunks in fp32; each returned gradient has its
input's dtype (fp32 master W under autocast, bf16 everywhere in DeepSpeed's bf16 model). ignore_index is -1;
a batch with no target gives nan losses, like F.cross_entropy. No host read: N stays on the device.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

CHUNK_BYTES = 8 * 2**20  # fp32 logits of one pass for one chunk of rows, on CPU
GPU_CHUNK_BYTES = 256 * 2**20  # ... on a GPU: per-chunk passes over W and grad_W stay small beside the matmuls
MIN_ROWS = 32  # fewer rows make the head's matmuls too thin to run well


def rows_per_chunk(vocab_size: int, device_type: str = "cpu") -> int:
    """Rows (tokens) of one chunk: the chunk's fp32 (rows, V) logits within CHUNK_BYTES on CPU, GPU_CHUNK_BYTES
    on any other device (cuda, and meta: `tlf plan` traces a GPU's step), at least MIN_ROWS."""
    size = CHUNK_BYTES if device_type == "cpu" else GPU_CHUNK_BYTES
    return max(MIN_ROWS, size // (4 * vocab_size))


class LMHead(nn.Linear):
    """The LM head W (V, d), no bias. `head(x)` -> logits (..., V); `head(hf, targets, hs, lambda_short,
    lambda_align)` -> the fused objective (`head_objective`); `head(hf, targets, rows=True)` -> each token's
    cross-entropy (B, T), detached (`head_rows`). Every entry runs through Module.__call__, so
    DeepSpeed ZeRO-3's module hooks gather W for either; its tensors go positionally so the hooks see them."""

    def __init__(self, d_model: int, vocab_size: int):
        super().__init__(d_model, vocab_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        targets: torch.Tensor | None = None,
        x_short: torch.Tensor | None = None,
        lambda_short: float = 0.0,
        lambda_align: float | None = None,
        align_scored: bool = False,
        weight: torch.Tensor | None = None,
        rows: bool = False,
    ):
        if targets is None:
            return F.linear(x, self.weight)  # (..., V)
        if rows and weight is None:  # each token's cross-entropy alone, no gradient
            return head_rows(x, self.weight, targets)
        return head_objective(
            x,
            self.weight,
            targets,
            x_short,
            lambda_short,
            lambda_align,
            align_scored=align_scored,
            weight=weight,
            rows=rows,
        )


def head_objective(
    hf: torch.Tensor,
    W: torch.Tensor,
    targets: torch.Tensor,
    hs: torch.Tensor | None = None,
    lambda_short: float = 0.0,
    lambda_align: float | None = None,
    chunk: int | None = None,
    align_scored: bool = False,
    weight: torch.Tensor | None = None,
    rows: bool = False,
) -> tuple[torch.Tensor, ...]:
    """hf (B, T, d) full-pass states, W (V, d), targets (B, T) (-1 ignored), hs (B, T, d) shortcut-pass states
    or None (no shortcut pass: loss = CE of hf alone); lambda_align None: no logits alignment (the caller adds
    its own, e.g. on the hidden states); align_scored: the alignment averages over the rows with a target only
    (default: every row). chunk: rows per chunk (default `rows_per_chunk(V)`). weight (B, T) or None: each
    token's weight on the full pass's cross-entropy (differentiable; module doc). Returns the differentiable
    loss () and its detached parts (3,) fp32: loss_L (unweighted), loss_S, loss_align (0 where absent). rows (with
    weight): also each token's full-pass cross-entropy (B, T) fp32, detached, 0 where ignored (the expected recipe's
    per-exit losses, which a router recipe's hard-token target reads)."""
    assert weight is not None or not rows, "rows: the per-token losses are kept only with weights"
    cdt = _compute_dtype(hf)
    chunk = int(chunk or rows_per_chunk(W.shape[0], W.device.type))
    loss, parts, ce_rows = _HeadObjective.apply(
        hf,
        W,
        targets,
        hs,
        float(lambda_short),
        None if lambda_align is None else float(lambda_align),
        chunk,
        cdt,
        bool(align_scored),
        weight,
    )
    return (loss, parts, ce_rows) if rows else (loss, parts)


@torch.no_grad()
def head_rows(hf: torch.Tensor, W: torch.Tensor, targets: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """Each token's cross-entropy (B, T) fp32, 0 where ignored, no gradient: the values `head_objective(...,
    rows=True)` returns for the same states (the same chunks, dtypes and operations), without its gradients'
    matmuls (the kinds recipe reads them before the weighted heads run)."""
    B, T, d = hf.shape
    chunk = int(chunk or rows_per_chunk(W.shape[0], W.device.type))
    cdt = _compute_dtype(hf)
    x, y = hf.reshape(-1, d), targets.reshape(-1)
    out = torch.empty(B * T, dtype=torch.float32, device=hf.device)
    with torch.autocast(hf.device.type, enabled=False):
        Wc = W.to(cdt)
        for a in range(0, B * T, chunk):
            b = min(a + chunk, B * T)
            yc = y[a:b]
            out[a:b] = _nll((x[a:b].to(cdt) @ Wc.t()).float(), yc.clamp_min(0)[:, None], (yc != -1).float())[1]
    return out.view(B, T)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The matmuls' dtype for t's device: autocast's when autocast is on there, else t's own."""
    dev = t.device.type
    if hasattr(torch, "get_autocast_dtype"):  # torch >= 2.4
        return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else t.dtype
    if dev == "cuda":  # torch 2.3 (setup.py allows it)
        return torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else t.dtype
    return torch.get_autocast_cpu_dtype() if torch.is_autocast_cpu_enabled() else t.dtype


def _nll(logits: torch.Tensor, y: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (r, V) fp32, y (r, 1) int64 in 0..V-1, valid (r,) -> (logsumexp (r,), CE per row (r,), 0 where
    valid is 0)."""
    lse = torch.logsumexp(logits, -1)  # (r,)
    return lse, (lse - logits.gather(1, y)[:, 0]).mul_(valid)


def _ce_grad_(logits: torch.Tensor, y: torch.Tensor, scale: torch.Tensor, valid: torch.Tensor):
    """In place: logits (r, V) fp32 -> scale * (softmax - onehot(y)); y (r, 1) int64 clamped into 0..V-1,
    scale (r,) (0 on ignored rows). Returns the chunk's CE per row (r,), 0 where valid (r,) is 0, and the
    gradient (the logits' storage)."""
    lse, nll = _nll(logits, y, valid)
    logits.sub_(lse[:, None]).exp_()  # softmax
    logits.scatter_add_(1, y, torch.full_like(y, -1, dtype=logits.dtype))
    return nll, logits.mul_(scale[:, None])


def _acc_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc (V, d) fp32 += a @ b, the product in a's dtype."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    else:
        acc.add_(a @ b)


class _HeadObjective(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hf, W, targets, hs, lam_s, lam_a, chunk, cdt, scored, weight):
        with torch.autocast(hf.device.type, enabled=False):
            needs = ctx.needs_input_grad
            loss, parts, rows, saved = _fused(hf, W, targets, hs, lam_s, lam_a, chunk, cdt, needs, scored, weight)
        ctx.save_for_backward(*saved)
        ctx.mark_non_differentiable(parts, rows)
        return loss, parts, rows

    @staticmethod
    def backward(ctx, g, _g_parts, _g_rows):
        g_hf, g_W, g_hs, g_w = ctx.saved_tensors
        scale = lambda t: None if t is None else t * g
        return scale(g_hf), scale(g_W), None, scale(g_hs), None, None, None, None, None, scale(g_w)


def _fused(hf, W, targets, hs, lam_s, lam_a, chunk, cdt, needs, scored=False, weight=None):
    """The forward of `_HeadObjective`: (loss, parts, rows, (grad_hf, grad_W, grad_hs, grad_weight)) with None for
    a gradient not needed; rows (B, T): each token's full-pass cross-entropy with weights (0 where ignored), else
    an empty tensor. scored: the alignment over rows with a target only (mean over count * V entries);
    weight (B, T) or None: per-row weights of the full pass's cross-entropy."""
    B, T, d = hf.shape
    V = W.shape[0]
    n = B * T
    x = hf.reshape(n, d)  # (n, d)
    xs = None if hs is None else hs.reshape(n, d)
    y = targets.reshape(n)
    valid = (y != -1).float()  # (n,)
    count = valid.sum()  # () N, on the device
    inv = 1.0 / count.clamp_min(1.0)  # all ignored: zero gradients (the loss is nan, as F.cross_entropy gives)
    Wc = W.to(cdt)  # (V, d)
    g_x = torch.empty_like(x) if needs[0] else None
    g_xs = torch.empty_like(xs) if xs is not None and needs[3] else None
    g_W = torch.zeros(V, d, dtype=torch.float32, device=W.device) if needs[1] else None
    w = None if weight is None else weight.reshape(n).float()  # (n,)
    ce_rows = torch.empty(n, dtype=torch.float32, device=hf.device) if w is not None else None  # w's gradient
    sums = torch.zeros(3, dtype=torch.float32, device=hf.device)  # CE_f, CE_s, sum w CE_f
    # the squared logit gap: per-row norms (fp32 tree reductions over V, no temporary), summed over rows in fp64;
    # one fp32 dot over millions of logits per chunk drifted ~1e-5 relative
    gap2 = torch.zeros((), dtype=torch.float64, device=hf.device)
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        xc, yc, vc = x[a:b].to(cdt), y[a:b].clamp_min(0)[:, None], valid[a:b]  # (r, d), (r, 1), (r,)
        lf = (xc @ Wc.t()).float()  # (r, V)
        glf = gls = None
        if xs is not None:
            xsc = xs[a:b].to(cdt)
            ls = (xsc @ Wc.t()).float()  # (r, V)
            gap = ls - lf if lam_a is not None else None  # (r, V), taken before ls becomes its gradient
            ce, gls = _ce_grad_(ls, yc, vc * inv * lam_s, vc)
            sums[1] += ce.sum()
            if gap is not None:
                _align_grad_(gls, gap, vc, inv, lam_a, scored, n, gap2)
                del gap
        ce, glf = _ce_grad_(lf, yc, vc * inv if w is None else vc * w[a:b] * inv, vc)
        sums[0] += ce.sum()
        if w is not None:
            sums[2] += (ce * w[a:b]).sum()
            ce_rows[a:b] = ce
        _backprop_chunk(glf, gls, xc, xsc if xs is not None else None, Wc, g_x, g_xs, g_W, a, b)
        del lf, glf, gls
    align = gap2 * inv.double() / V if scored else gap2 / (n * V)
    parts = torch.stack([sums[0] / count, sums[1] / count, align.float()])  # loss_L, loss_S, loss_align
    loss = (sums[0] if w is None else sums[2]) / count  # (): not a view of parts (a separate output)
    if xs is not None:
        loss = loss + lam_s * parts[1] + (lam_a * parts[2] if lam_a is not None else 0.0)
    g_W = None if g_W is None else g_W.to(W.dtype)
    view = lambda t: None if t is None else t.view(B, T, d)
    g_w = None if (w is None or not needs[9]) else (ce_rows * inv).view(B, T).to(weight.dtype)
    rows = ce_rows.view(B, T) if ce_rows is not None else hf.new_empty(0, dtype=torch.float32)
    return loss, parts, rows, (view(g_x), g_W, view(g_xs), g_w)


def _align_grad_(gls, gap, vc, inv, lam_a, scored, n, gap2) -> None:
    """In place: the alignment's gradient 2 lam_a (ls - lf) / (entries) added into the shortcut pass's logit gradient
    gls (r, V) (entries: n * V, or count * V over the scored rows only), and the chunk's squared logit gap added into
    gap2 (fp64); gap (r, V) = ls - lf is used up."""
    V = gap.shape[1]
    if scored:
        gap.mul_(vc[:, None])  # rows without a target leave the alignment
    gap2 += torch.linalg.vector_norm(gap, dim=-1).double().square().sum()  # (r,): no (r, V) temporary
    if scored:  # the mean over count * V entries: count is on the device
        gls.add_(gap.mul_(inv * (2.0 * lam_a / V)))
    else:
        gls.add_(gap, alpha=2.0 * lam_a / (n * V))


def _backprop_chunk(glf, gls, xc, xsc, Wc, g_x, g_xs, g_W, a, b) -> None:
    """Rows a:b of grad_hf (grad_hs) = the chunk's logit gradient glf (gls, None without a shortcut pass) @ W, and
    grad_W += glf^T xc (+ gls^T xsc), each gradient buffer None when not needed. The products are in W's compute
    dtype (Wc's); its copies of glf and gls go when this returns."""
    glf = glf.to(Wc.dtype)
    if g_x is not None:
        g_x[a:b] = glf @ Wc
    if g_W is not None:
        _acc_(g_W, glf.t(), xc)
    if gls is not None:
        gls = gls.to(Wc.dtype)
        if g_xs is not None:
            g_xs[a:b] = gls @ Wc
        if g_W is not None:
            _acc_(g_W, gls.t(), xsc)
