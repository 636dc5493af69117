"""One process of tests/test_multiprocess.py, run under ``python -m gshard.launch``.

Usage: ``python -m gshard.launch -n 2 -d 4 tests/mp_worker.py OUT_DIR CASE...``.
Runs each case of tests/mp_cases.py; process 0 writes ``OUT_DIR/CASE.npz``.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gshard.distributed  # noqa: E402

gshard.distributed.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402

import mp_cases  # noqa: E402


def main(out_dir, names):
  assert jax.device_count() == 8, (
      jax.process_count(), jax.device_count())
  for name in names:
    res = mp_cases.CASES[name]()
    if jax.process_index() == 0:
      state = res.pop("state")
      np.savez(os.path.join(out_dir, f"{name}.npz"), process_count=jax.process_count(),
               **res, **{f"state_{i}": x for i, x in enumerate(state)})
    print(f"{name}: losses {res['losses'].tolist()}", flush=True)


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2:])
