"""Training runs: `train` and what it is told (`Sampling`, `Evaluation`, `Checkpointing`) and records (`History`).

    sampling = fo.Sampling(clients_per_round=10, batch_size=20, local_steps=5)
    state, history = fo.train(algo, state, dataset, 300, sampling,
                              evaluation=fo.Evaluation(every=10, metric_fns={"accuracy": model.accuracy_fn}))

One idea per module: `driver` (the chunked rounds), `config` (the
records), `evaluation` (what is evaluated between chunks), `history`,
`checkpoint`, `safety` (memory check, divergence), `progress` and
`accounting` (the ε of a `dp_mean` run, for the clients it draws).
"""

from fedjax_opt.train.accounting import holds_dp_mean, run_sampling
from fedjax_opt.train.checkpoint import CheckpointError, Checkpointer, CheckpointWarning, current_round
from fedjax_opt.train.config import Accounting, Checkpointing, Evaluation, Sampling
from fedjax_opt.train.driver import is_host_driven, proportional_weights, train
from fedjax_opt.train.evaluation import PERSONALIZED_PERCENTILE
from fedjax_opt.train.history import History
from fedjax_opt.train.safety import (BatchSizeWarning, DivergenceWarning, RoundTooLargeError, check_fits,
                                     compiled_bytes, divergence)

__all__ = [
    "train", "Sampling", "Evaluation", "Checkpointing", "Accounting", "History",
    "Checkpointer", "CheckpointError", "CheckpointWarning", "current_round",
    "RoundTooLargeError", "DivergenceWarning", "BatchSizeWarning", "check_fits", "compiled_bytes", "divergence",
    "is_host_driven", "proportional_weights", "PERSONALIZED_PERCENTILE", "holds_dp_mean", "run_sampling",
]
