"""The hand-written analysis at the end of docs/benchmarks-client.md.

Refers to the measured sections above it, which benchmarks/client.py writes. The
diagnosis numbers were measured separately (standalone scripts, 8 simulated CPU
devices on the same 2 shared cores) and are quoted as ranges over reruns.
"""

NOTES = """
### Bytes: gshard sends no more than GSPMD on any case

- `lm_megatron`: the per-layer activation all-reduces are the same on both sides.
  GSPMD all-reduces the input gradients of the q, k and v projections one by one
  (a tuple of three [B/2, T, D] tensors per layer); gshard adds them while they
  are still pending sums and all-reduces the sum once, as in run.py's GPT.
- `lm_fsdp`: GSPMD all-reduces whole weight gradients and then slices out each
  device's part (the `dynamic-slice`s of its program); gshard reduce-scatters
  them, half the bytes, and gathers each weight where it is used, as GSPMD does
  (the activations keep their batch split through the attention's output
  projection). The token embedding is the exception: gshard moves the table
  from its vocabulary split to a feature split (an all-to-all of 1/8 of it),
  gathers the int32 tokens, looks up each device's features and moves the rows
  back to the batch split (an all-to-all): 87.5 KiB against 224 KiB for
  gathering the table. Its gradient is the mirror image (84 KiB), against
  GSPMD's all-reduce of the whole table gradient (448 KiB).
- `lm_dp`: one all-reduce of all gradients on both sides, the same bytes.
- `lm_accum` (`lm_fsdp`'s layout, the gradient summed over 2 micro-batches by a
  scan): both compute each micro-batch data parallel (the model's logical
  constraints split the activations' batch inside the loop). gshard moves the
  tokens' rows once, before the loop (collective permutes of 256 B), gathers
  the weights in each micro-batch and reduce-scatters each micro-batch's
  weight gradients into the split sum (FSDP's pattern, per micro-batch); the
  MLP's hidden activation stays batch split inside the loop (the loop body is
  laid out for its readers, `spmd/readers.py`; before, it was moved to the
  feature split and back in every trip, 7.51 MiB a step). GSPMD all-reduces
  the whole gradient in each iteration (3.13 MiB a micro-batch) before
  slicing out each device's part.
- `resnet`: both exchange the same halos (collective permutes) in the spatially
  split stem. After it, GSPMD gathers activations around the channel-split
  convolutions and all-reduces their input gradients; gshard moves more of the
  small weights (all-gathers and all-to-alls of 3x3 kernels) and reduce-scatters
  the input gradients.

### Step time on `lm_megatron`: weight gradients reduced after their transpose

When `lm_megatron` misses the 1.1 bar, the cause is how XLA:CPU compiles five
weight-gradient matmuls, not communication (the bytes are lower and the
collectives sit at the same places in both programs).

jax differentiates `y = x @ W` (x [B, T, D], W [D, F]) into
`dW_t = dot_general(g, x)` ([F, D], contracting batch and length) followed by
`transpose(dW_t)`. With the batch split over `data`, `dW_t` is a partial sum
over `data`.

- GSPMD all-reduces `dW_t` at the dot and transposes after the all-reduce.
- gshard keeps the sum pending through the transpose and all-reduces `dW`.

XLA then folds the transpose into the dot. The result is a dot that contracts
dim 0 of both operands, which XLA:CPU runs as a plain Eigen dot thunk after
copying one operand transposed. In GSPMD's order the dot stays canonical and
runs as a YNNPACK (`__ynn_fusion`) dot. The optimized HLO of `lm_megatron` has 5
top-level `dot` instructions under gshard (both MLP kernels of both blocks, and
the logits kernel, all `[512,128]ᵀ·[512,128]` per device) and none under GSPMD.

- **Five such weight gradients alone** (the LM's per-device shapes, mesh
  data=2 x model=4): gshard is 1.7-1.9x slower than GSPMD. Written by hand in
  `shard_map` with psum after vs before the transpose, the per-device program is
  1.7x slower in gshard's order, so the order alone explains the gap.
- **The whole step, with gshard's psums moved before the transpose**: the test
  patches jax's dot_general transpose rule to put a fully `UNCONSTRAINED`
  `with_sharding_constraint` between the dot and its transpose. That is a no-op
  for GSPMD, and gshard resolves pending sums before an annotation. It takes
  gshard's top-level dots from 5 to 0 and its step-time ratio from 1.22-1.43x to
  0.93-1.03x (gshard CPU time per step: 1.13-1.16x down to 0.93-1.02x).
- **Bytes are the same** either way, since a transpose keeps the size. The fix
  belongs in the partitioner: resolve a pending sum before a `transpose` whose
  operand is a `dot_general` (a psum_scatter can be moved back through the
  permutation the same way).
- `lm_dp` has the same pattern: 7 top-level dots under gshard, 2 under GSPMD.
  But its per-device matmuls are small (2 sequences per device), gshard is at
  parity there, and the same patch made gshard's `lm_dp` slower in two of two
  runs (1.15-1.25x, noisy). Measure the fix on both layouts.

A smaller difference is in the vocab-parallel cross entropy (`optax
.softmax_cross_entropy_with_integer_labels` on logits split over `model`). The
backward of its `take_along_axis` is a scatter-add of the label gradient:

- gshard scatters into a fresh zero buffer ([B/2, T, V/4]), labels owned by
  another shard sent out of bounds and dropped, then adds it to the softmax
  gradient.
- GSPMD scatters into the softmax gradient in place, with out-of-shard
  indices dropped as out of bounds.

gshard used to scatter into one extra trash column ([B/2, T, V/4 + 1]) and
slice it off; a hand `shard_map` of that form was 1.15x slower than GSPMD's,
about 0.5 ms of a ~100 ms step. The zero buffer and its add remain.

### Reading the step times

The 8 simulated devices share 2 cores with other processes, and most of a step
is spent waiting at collectives. Medians move by 20-40% between reruns of the
same program. The ratio of two interleaved medians is steadier, but on these
cases it still moves by about 0.1 between runs. Treat a ratio within 0.1 of the
bar as a tie. Process CPU time per step is steadier than wall time and agrees
with the diagnosis above.

### Writing the Flax code

Nothing in the models names gshard. One Flax detail: `nn.DenseGeneral`, inside
`nn.SelfAttention`, calls `kernel_init` on the kernel flattened to 2-D and
checks it again under `apply`. So under a mesh, the logical names given to the
attention kernels must be those of the flat kernel: `("embed", "heads")` for
q/k/v and `("heads", "embed")` for the output projection. Three names on the
3-D kernel fail with a rank error from `with_sharding_constraint`, under both
systems.
"""
