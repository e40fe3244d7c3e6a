"""`macspec distill`: train a draft for any target from the target itself, then measure it.

Every stage writes incrementally into a work directory, so `--resume` continues:

- data.py: continuations sampled from the target over a varied prompt set (train_prompts.py),
  batched, at a mix of temperatures; per token the id and the target's hidden states, in shards.
- training.py: the draft (core/drafters/eagle.py) by distillation, AdamW with warm-up and cosine
  decay, unrolled drafting steps, checkpoints; seeded.
- evaluation.py: held-out agreement, then acceptance and mean accepted length at K=4
  (temperature 0 and 0.7) on the built-in benchmark prompts (never trained on) and the speed
  against plain decoding; report.json next to the model.
- command.py: `distill()`, the stages in order, and the command; config.py: its options.
"""

from .command import distill, register
from .config import DistillConfig

__all__ = ["DistillConfig", "distill", "register"]
