"""Beyond one device: meshes, row-sharded embeddings, quantized collectives, the sharded
train step, checkpoints that restore onto another mesh and the bytes model of the step's
collectives (traffic.py; docs/PARALLEL.md)."""
from loka_jax.parallel.collectives import (MODES, Codec, all_gather, all_reduce, all_to_all,
                                           measure, reduce_scatter, tree_all_reduce)
from loka_jax.parallel.embedding import ShardedLookup, sharded_embeddings
from loka_jax.parallel.mesh import (AXES, BATCH_AXES, DATA, MODEL, MeshSpecError, build_mesh,
                                    default_mesh_spec, format_mesh_spec, initialize_distributed,
                                    parse_mesh_spec, shard_map)
from loka_jax.parallel.step import (ParallelConfig, TableLayout, all_gathers,
                                    batch_partition_specs, init_sharded_state,
                                    make_loss_and_grads, make_train_step, padded_rows,
                                    shard_batch, shard_state, state_partition_specs,
                                    state_shardings, table_layout, unexpected_all_gathers,
                                    unshard_state)
