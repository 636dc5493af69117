"""One process of tests/test_multiprocess.py::test_a_dead_process_stops_the_others.

Usage: ``python -m gshard.launch -n 2 -d 4 tests/mp_fault.py VICTIM``. Trains the
Megatron MLP; after step 3, process VICTIM kills itself (SIGKILL), the other
goes on training and must be stopped by JAX's runtime.
"""

import os
import signal
import sys

import gshard.distributed

gshard.distributed.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gshard  # noqa: E402
from examples import models  # noqa: E402

victim = int(sys.argv[1])
mesh = gshard.make_mesh((2, 4), ("data", "model"))
rng = np.random.default_rng(0)
params = {"w1": rng.standard_normal((32, 64), np.float32) / 32 ** 0.5,
          "w2": rng.standard_normal((64, 32), np.float32) / 8.0}
x = rng.standard_normal((16, 32), np.float32)
step = gshard.partition(models.sgd_step(models.mlp_loss), mesh,
                        in_specs=(models.MLP_SPECS, P("data"), P("data")))
for i in range(1, 10_000):
  params, loss = step(params, x, x)
  print(f"step {i} loss {float(loss):.6f}", flush=True)
  if i == 3 and jax.process_index() == victim:
    print(f"process {victim}: SIGKILL", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
