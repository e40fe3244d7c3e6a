"""distill's unrolled training steps checked against what the drafter computes with its cache
(tests/tools/test_distill.py for the eagle kind, test_distill_eagle3.py for eagle3)."""

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from macspec.core.target import hidden_states
from macspec.tools.distill.training import unrolled


def assert_unrolled_steps_attend_as_drafting_does(draft, target, taps, layers: int) -> None:
    """Step s at position t = the s-th draft token after anchor t - s, attending to the real
    positions up to the anchor and to its own earlier drafted positions only."""
    ids = mx.array([1, 9, 4, 7, 12, 3, 8, 10, 2, 6])
    feats = hidden_states(target, ids[:-1], None, taps)[None]
    embeds = target.model.embed_tokens(ids[1:])[None]
    outs = unrolled(draft, draft.state(feats), embeds, 3)
    for anchor in (0, 2, 5):
        cache = [KVCache() for _ in range(layers)]
        out = draft.step(draft.state(feats[:, : anchor + 1]), embeds[:, : anchor + 1], cache)
        out = out[:, -1:]
        assert mx.allclose(out[0, 0], outs[0][0, anchor], atol=1e-4).item()
        for s in (1, 2):
            t = anchor + s
            out = draft.step(out, embeds[:, t : t + 1], cache)
            assert mx.allclose(out[0, 0], outs[s][0, t], atol=1e-4).item(), (anchor, s)
