"""Training: optimizers, metrics (NE, AUC, log loss), train state, orbax checkpoints, the loop."""
from loka_jax.train.checkpoint import Checkpointer, CheckpointError
from loka_jax.train.loop import (NAN_POLICIES, WALL_CLOCK_FIELDS, NonFiniteError, RunSettingsError,
                                 TrainConfig, compiled_steps, evaluate, locate_non_finite,
                                 read_metrics, restore_run, train)
from loka_jax.train.metrics import (EvalAccumulator, auc, bce_with_logits, binary_entropy,
                                    json_safe, normalized_entropy)
from loka_jax.train.optim import OptimConfig, make_optimizer, scale_by_rowwise_adagrad
from loka_jax.train.state import TrainState, create_train_state
