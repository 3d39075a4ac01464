"""GPU diagnosis only (never committed): DIAG_VARIANT changes how torch.compile runs in every process."""
import os

_v = os.environ.get("DIAG_VARIANT", "")
if _v in ("nosplit", "static", "noloss"):
    import torch
    if _v == "nosplit":
        import torch._inductor.config as _c
        _c.split_reductions = False
    _orig = torch.compile

    def _compile(fn=None, *a, **kw):
        if _v == "static":
            kw["dynamic"] = False
        if _v == "noloss" and getattr(fn, "__name__", "") == "fused_chunk_loss":
            return fn
        return _orig(fn, *a, **kw)

    torch.compile = _compile
