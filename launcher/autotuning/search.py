"""The order in which candidates run (autotuning.tuner_type, DeepSpeed's three tuners).

gridsearch: the grid's order (stage, offload, micro-batch, bucket). random: a shuffle with a
fixed seed, so a tune is repeatable. model_based: two random trials, then always the candidate a
cost model fitted to every measured trial predicts best: log(metric) linear in the stage (one
column per stage), offload, log2 of the micro-batch and of the bucket size (least squares).
Failed trials count as the worst metric seen. The caller stops after tuner_num_trials trials or
tuner_early_stopping trials in a row without a better metric.
"""

import math
import random

import torch

from .space import Candidate

SEED = 0
RANDOM_START = 2  # model_based: trials before the cost model has data


def features(candidate: Candidate) -> list[float]:
    stages = [1.0 if candidate.stage == s else 0.0 for s in (1, 2, 3)]
    bucket = math.log2(candidate.bucket) if candidate.bucket else 0.0
    offload = 0.0 if candidate.offload == "none" else 1.0
    return [1.0, *stages, offload, math.log2(candidate.micro_batch), bucket]


class Search:
    """Hands out the next candidate to run; `record` tells it a trial's metric (higher is
    better; None for a failed trial)."""

    def __init__(self, candidates: list[Candidate], tuner_type: str):
        self.tuner_type = tuner_type
        self.left = list(candidates)
        if tuner_type != "gridsearch":
            random.Random(SEED).shuffle(self.left)
        self.measured: list[tuple[Candidate, float | None]] = []

    def next(self) -> Candidate | None:
        if not self.left:
            return None
        if self.tuner_type == "model_based" and len(self.measured) >= RANDOM_START:
            best = max(self.left, key=self._predicted)
            self.left.remove(best)
            return best
        return self.left.pop(0)

    def record(self, candidate: Candidate, metric: float | None) -> None:
        self.measured.append((candidate, metric))

    def _predicted(self, candidate: Candidate) -> float:
        known = [m for _, m in self.measured if m is not None and m > 0]
        if not known:
            return 0.0
        worst = min(known)
        x = torch.tensor([features(c) for c, _ in self.measured], dtype=torch.float64)
        y = torch.tensor(
            [[math.log(m if m is not None and m > 0 else worst)] for _, m in self.measured],
            dtype=torch.float64,
        )
        # lstsq with the gelsd driver gives the minimum-norm fit when columns are not yet
        # determined by the few trials so far (an unseen stage's column stays 0).
        weights = torch.linalg.lstsq(x, y, driver="gelsd").solution
        return float(torch.tensor([features(candidate)], dtype=torch.float64) @ weights)
