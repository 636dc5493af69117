"""Hand-written analysis appended to docs/benchmarks.md by benchmarks/run.py.

It explains the byte counts, which are deterministic for a given commit; if the
partitioner changes, rerun ``make bench``, compare with the collective listings
in the doc and update this text.
"""

NOTES = r"""
Written against the listings above (shapes are per device: B/dp = 8 sequences of
T = 128 tokens, D = 256, f32).

**Megatron MLP and data-parallel MLP: bars met on bytes.** gshard and GSPMD emit
the same collectives, and their bytes equal the analytic minimum: one forward
all-reduce over `model` of the [B/dp, D] output of the row-parallel matmul, and one
tuple all-reduce over `data` of the gradient shards of w1, w2 and the loss. No
backward activation all-reduce is needed, because x is data and its gradient is not
computed.

**Transformer, gshard vs GSPMD: gshard sends 30% fewer bytes (16.21 vs 23.03 MiB).**
GSPMD's extra 6.82 MiB:

1. +6.00 MiB, the input gradient of attention. x feeds the three column-parallel
   projections q, k and v. Each transposed einsum (`transpose(jvp(btd,dhk->bthk))`)
   gives a partial sum over `model` of a [B/dp, T, D] cotangent. GSPMD all-reduces
   all three: one tuple all-reduce with 3 x 1 MiB operands, 4.5 MiB sent per layer.
   gshard adds the three partial sums first and reduces once, 1.5 MiB per layer.
   The saving is 3 MiB per layer, 2 layers.
2. +256 KiB, the gradient of the tied embedding. It has two parts: the scatter-add
   of the lookup and the dot_general of the logits matmul. GSPMD all-reduces both
   [V/mp, D] = [256, 256] parts over `data` separately; its data all-reduce has a
   2.00 MiB operand against gshard's 1.75 MiB. gshard adds the two parts first.
3. +6 KiB, the cross-entropy statistics. GSPMD all-reduces the gathered target
   logit (`take_along_axis`, [B/dp, T, 1]) over `model`, on top of the max, the sum
   of exp and the backward sum: 4 small all-reduces against 3.
4. +576 KiB, the tied embedding's lookup. GSPMD looks up each device's vocabulary
   rows (zeros elsewhere) and all-reduces the [B/dp, T, D] result over `model`
   (1.5 MiB). gshard moves the table's [V/mp, D] block to a feature split
   [V, D/mp] (one all-to-all, 192 KiB), looks up each device's features and
   all-gathers the result (768 KiB, half the all-reduce).

**Transformer, gshard at the analytic minimum.** All 9 large all-reduces (4 per
layer and the tied logits' input gradient backward), the embedding lookup's
all-to-all and all-gather, and the 3 small vocab-parallel statistics are at the
minimum. All-gathering the whole table for the lookup (768 KiB, no all-to-all)
would send 192 KiB less, but holds the table whole on every device, which gshard
does not do where the table arrives split. The minimum is that
of the program autodiff produces: the log-softmax's backward sums its cotangent
over the vocabulary (Σ_v, a third [B/dp, T] all-reduce over `model`), which
Megatron-LM's hand-written backward replaces by the constant -1/N. The gathered
target logit needs no all-reduce of its own: gshard keeps it a pending sum over
`model` through the mean down to the scalar and reduces the loss over
`data`×`model` (2·7/8·4 = 7 B instead of the 4 B of a `data` all-reduce, against
6 KiB for a fourth statistic).

The layer-norm backward is where this needed care. The cotangent reaching
each layer norm is a pending partial sum over `model` (from the transposes of
the q/k/v projections, of w1, or of the tied logits matmul). Carried through the
linear layer-norm backward, it would need two psums (the [B/dp, T, D] term and
a [B/dp, T] variance-gradient term) and would leave the layer-norm scale
gradients partial over `data`×`model`. gshard's partial-sum pass sees that one
psum of the incoming cotangent costs less than the psums it fans out into, and
reduces it where it is produced (docs/design.md, "Partial sums, revisited").

**MoE with the paper's three annotations: at the minimum, 1/7 of GSPMD's bytes.**
`split(inputs, G)`, `replicate(wg)`, `split(dispatched, E)` and nothing else.
gshard runs the dispatch einsum where its operands are and moves the result
from G to E by one all-to-all, the combine the same way back, and the backward
the mirror image: four all-to-alls of one [E, G/n, C, M] block, plus the
all-reduce of the replicated gating weights' gradient and of the loss. GSPMD
reaches the E-split layout by gathering (all-gathers and all-reduces of the
dispatched and combined tensors).

**Flax ResNet with output channels over `model`: half of GSPMD's bytes, no
all-to-all.** Each convolution all-gathers its channel-split input once and
keeps it for the backward, where GSPMD gathers it a second time; the input
gradients, partial sums over `model`, are reduce-scattered back to the
channel split. Each kernel's gradient comes out in the kernel's own layout
(output channels split), so the optimizer update (optax SGD with momentum)
needs no resharding.

**Step time.** The two programs do the same work. Their `cost_analysis()` flops are
3.12e9 and 3.13e9 per device and their bytes accessed differ by less than 1%, so the
step-time ratio mostly measures noise. On simulated devices an all-reduce is a
memory copy inside one process, so the 6 MiB gshard saves per step is worth little
here; on a real interconnect it would matter. These timings come from a 2-core
machine that other processes were also using (see the load average in the header).
Where the interquartile ranges of the two systems overlap, treat the ratio as "no
measurable difference". Over five runs while this was written (load averages 6-16,
25 steps each), the Transformer ratio was between 0.99 and 1.05 and the MLP ratios
between 0.8 and 1.16. The sign flipped between runs, so a single run that misses the
10% bar says nothing on its own. For the two MLPs the bars above say more: XLA
compiled gshard's program into GSPMD's, instruction for instruction
(`benchmarks/hlo.py` `same_program`: names, channel ids and the spelling of device
groups aside), so their ratio is 1 up to noise. gshard's timings also include its Python dispatch
(`Partitioned.__call__` looks up the signature cache and `device_put`s each leaf;
the inputs are already placed, so nothing moves). This matters only for the
millisecond-scale MLP steps.

The ResNet used to be the exception, about 12% slower than GSPMD on some machines
(an interleaved A/B of 150 steps each on an idle 2-core Intel host: 35.0 against
31.2 ms). A profile of both programs (`jax.profiler`, per XLA:CPU thunk, summed
over the 8 device threads) put the difference in the reduce-scatters of the input
gradients. Each scatters the channel dim, the minor one, and XLA:CPU copied the
[8, 16, 16, 32] partial sum to a channel-major layout first, element by element,
and its result back. gshard now runs a reduce-scatter or all-gather onto an inner
dim on a leading dim of the blocks when the devices are CPUs (`[8, 16, 16, 4, 8]`
to `[4, 8, 16, 16, 8]`, a copy of 8-float runs, then a scatter of dim 0; README,
"On CPU devices"). The same values and bytes; in interleaved A/Bs of the same step
compiled both ways the ResNet runs 0.84-0.88x as long as before, 0.94-0.98x GSPMD's,
and the client FSDP LM, whose gathers are on inner dims too, 1.00-1.04x instead of
1.06-1.09x.

**Memory.** Per-device memory is the same within 1%. Note that `out_specs=None`
lets each system pick its own output layouts.

**Overhead.** gshard's own time for a new signature (trace, propagation, partitioner
set-up, and the lowering that runs the partitioning interpreter) is well below XLA's
compile time of the same program on every model. It is similar to GSPMD's front-end
time (jax trace + lower) and up to about twice it in some runs; the extra is
propagation and the interpreter.
"""
