"""A Flax NNX Transformer language model, partitioned by gshard.

The model is written the way Flax NNX users write it: ``nnx.Module`` classes
built from ``nnx.Embed``, ``nnx.LayerNorm``, ``nnx.Linear``/``nnx.LinearGeneral``,
``nnx.Dropout`` and ``nnx.dot_product_attention``, trained with ``nnx.Optimizer`` over optax's
AdamW. gshard needs three annotation lines (marked ``# gshard``): the batch over
``data``, and the attention heads and the MLP hidden dim over ``model``. The
parameter and optimizer-state layouts are not given: propagation infers them
from those annotations (the Megatron layout).

``gshard.partition`` takes functions of arrays, so the train step is written
as a pure function of ``(state, batch)``, with NNX's functional API:
``nnx.merge`` rebuilds the model and optimizer from the graph definition and
the state, ``nnx.state`` takes the new state out. The graph definition is
static and closed over. Dropout draws from ``nnx.Rngs(dropout=key(seed))``
made inside the step; each device draws its own block of the very masks the
1-device run draws.

Mixture of experts (``--moe``, ``create(num_experts=E)``): every other
feed-forward block (blocks 1, 3, ...) is a GShard MoE layer, ``MoEBlock``: an
``nnx.Module`` whose ``nnx.Param`` s are the router ``wg`` [M, E] and the
experts' ``wi`` [E, M, H] and ``wo`` [E, H, M], applied by
``gshard.moe.moe_apply`` (its own annotations, gshard/moe/layer.py). Each
sequence is one group of tokens for the gating (G = batch, S = sequence). The
batch axis doubles as the expert axis: the mesh keeps its names, ``data`` x
``model``, and the MoE splits tokens (G) and experts (E) over ``data``
(``expert_axis="data"``) and each expert's hidden dim over ``model``; so no new
annotation is needed elsewhere, and dispatch and combine are all-to-alls over
``data``. The MoE run uses the mesh data=4 x model=2 (four expert shards of two
experts each) rather than 2x4, so that the experts are spread over four
devices. The layer's auxiliary load-balancing loss is sown
(``nnx.Intermediate``), captured in the loss function (``nnx.capture``) and
added with weight ``AUX_LOSS_WEIGHT``. The second expert is routed the
paper's way (``second_policy="random"``) from an ``nnx.Rngs`` stream
``routing`` whose key is derived inside the step from the step's seed, like
dropout's: the partitioned step routes every token as the 1-device run does.

Run: ``python examples/flax_nnx.py`` (8 simulated CPU devices, mesh 2x4), or
``python examples/flax_nnx.py --moe`` (mesh 4x2, MoE every other block).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import gshard  # noqa: E402
from examples import models  # noqa: E402
from gshard.moe import moe_apply, moe_init  # noqa: E402

AUX_LOSS_WEIGHT = 1e-2      # weight of the MoE load-balancing loss in the training loss


class CausalSelfAttention(nnx.Module):
  def __init__(self, d_model: int, n_heads: int, *, rngs: nnx.Rngs):
    heads = (n_heads, d_model // n_heads)
    self.query = nnx.LinearGeneral(d_model, heads, use_bias=False, rngs=rngs)
    self.key = nnx.LinearGeneral(d_model, heads, use_bias=False, rngs=rngs)
    self.value = nnx.LinearGeneral(d_model, heads, use_bias=False, rngs=rngs)
    self.out = nnx.LinearGeneral(heads, d_model, axis=(-2, -1), use_bias=False,
                                 rngs=rngs)

  def __call__(self, x):
    q = gshard.shard(self.query(x), P("data", None, "model", None))  # gshard: heads
    y = nnx.dot_product_attention(q, self.key(x), self.value(x), is_causal=True)
    return self.out(y)


class MLP(nnx.Module):
  def __init__(self, d_model: int, d_ff: int, dropout: float, *, rngs: nnx.Rngs):
    self.up = nnx.Linear(d_model, d_ff, rngs=rngs)
    self.down = nnx.Linear(d_ff, d_model, rngs=rngs)
    self.dropout = nnx.Dropout(dropout)

  def __call__(self, x, rngs=None):
    h = nnx.gelu(self.up(x))
    h = gshard.shard(h, P("data", None, "model"))                 # gshard: hidden dim
    return self.dropout(self.down(h), rngs=rngs)


class MoEBlock(nnx.Module):
  """A GShard mixture-of-experts feed-forward layer, in place of an ``MLP``.

  The parameters are ``nnx.Param`` s, initialised by ``gshard.moe.moe_init``:
  the router ``wg`` [M, E] and the experts' ``wi`` [E, M, H], ``wo`` [E, H, M].
  ``moe_apply`` annotates them itself (``wg`` replicated, the experts split on
  E over ``expert_axis`` and on H over ``model_axis``); propagation carries
  that layout to the parameters and the optimizer state.

  Tokens [B, T, M] are the gating's groups [G, S, M]: one group per sequence.
  The second expert is kept at random (``second_policy="random"``) with a key
  from the ``routing`` stream of ``rngs``; without one (``rngs=None``, or no
  such stream) every second choice is used (``"all"``). The auxiliary
  load-balancing loss is sown as ``nnx.Intermediate`` ``aux_loss``.
  """

  def __init__(self, d_model: int, d_expert: int, num_experts: int, dropout: float, *,
               expert_axis="data", model_axis="model", capacity_factor: float = 2.0,
               rngs: nnx.Rngs):
    params = moe_init(rngs.params(), d_model, d_expert, num_experts)
    self.wg = nnx.Param(params["wg"])
    self.wi = nnx.Param(params["wi"])
    self.wo = nnx.Param(params["wo"])
    self.dropout = nnx.Dropout(dropout)
    self.expert_axis, self.model_axis = expert_axis, model_axis
    self.capacity_factor = capacity_factor

  def __call__(self, x, rngs=None):
    # x [B, T, M] is already the gating's [G, S, M]: one group per sequence
    key = rngs.routing() if rngs is not None and "routing" in rngs else None
    y, aux_loss, _ = moe_apply(
        {"wg": self.wg[...], "wi": self.wi[...], "wo": self.wo[...]}, x,
        expert_axis=self.expert_axis, model_axis=self.model_axis,
        capacity_factor=self.capacity_factor, key=key,
        second_policy="random" if key is not None else "all")
    self.sow(nnx.Intermediate, "aux_loss", aux_loss)
    return self.dropout(y, rngs=rngs)


class Block(nnx.Module):
  def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float, *,
               num_experts: int = 0, d_expert: int | None = None,
               expert_axis="data", model_axis="model", rngs: nnx.Rngs):
    self.ln1 = nnx.LayerNorm(d_model, rngs=rngs)
    self.attn = CausalSelfAttention(d_model, n_heads, rngs=rngs)
    self.ln2 = nnx.LayerNorm(d_model, rngs=rngs)
    if num_experts:
      self.mlp = MoEBlock(d_model, d_expert or d_ff, num_experts, dropout,
                          expert_axis=expert_axis, model_axis=model_axis, rngs=rngs)
    else:
      self.mlp = MLP(d_model, d_ff, dropout, rngs=rngs)

  def __call__(self, x, rngs=None):
    x = x + self.attn(self.ln1(x))
    return x + self.mlp(self.ln2(x), rngs=rngs)


class TransformerLM(nnx.Module):
  """Decoder-only language model with tied input/output embeddings.

  With ``num_experts > 0``, blocks 1, 3, ... have an ``MoEBlock`` of
  ``num_experts`` experts of hidden width ``d_expert`` (default ``d_ff``)
  instead of the ``MLP`` (GShard's every-other-layer MoE).
  """

  def __init__(self, vocab: int = 128, d_model: int = 64, n_heads: int = 4,
               n_layers: int = 2, d_ff: int = 256, dropout: float = 0.1, *,
               num_experts: int = 0, d_expert: int | None = None,
               expert_axis="data", model_axis="model", rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab, d_model, rngs=rngs)
    self.blocks = nnx.List([
        Block(d_model, n_heads, d_ff, dropout, num_experts=num_experts if i % 2 else 0,
              d_expert=d_expert, expert_axis=expert_axis, model_axis=model_axis,
              rngs=rngs)
        for i in range(n_layers)])
    self.ln_f = nnx.LayerNorm(d_model, rngs=rngs)

  def __call__(self, tokens, rngs=None):
    tokens = gshard.split(tokens, 0, "data")                      # gshard: batch
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x, rngs=rngs)
    return self.embed.attend(self.ln_f(x))


def create(seed: int = 0, learning_rate: float = 3e-3, **model_kw):
  """(graphdef, state) of the model and its AdamW optimizer."""
  model = TransformerLM(**model_kw, rngs=nnx.Rngs(seed))
  optimizer = nnx.Optimizer(model, optax.adamw(learning_rate), wrt=nnx.Param)
  return nnx.split((model, optimizer))


def train_step(graphdef, state, tokens, targets, dropout_seed):
  """One AdamW step; a pure function of arrays once ``graphdef`` is bound."""
  model, optimizer = nnx.merge(graphdef, state)
  key = jax.random.key(dropout_seed)

  def loss_fn(model):
    # dropout's stream, and the MoE's second-expert routing (unused when dense)
    rngs = nnx.Rngs(dropout=key, routing=jax.random.fold_in(key, 1))
    logits, sown = nnx.capture(model, nnx.Intermediate)(tokens, rngs=rngs)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    aux_losses = jax.tree.leaves(sown)                # MoEBlock's load-balancing losses
    if aux_losses:
      loss = loss + AUX_LOSS_WEIGHT * sum(aux_losses)
    return loss

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return nnx.state((model, optimizer)), loss


def partitioned_step(graphdef, mesh):
  """The train step partitioned over ``mesh``: the batch in_specs only."""
  return gshard.partition(functools.partial(train_step, graphdef), mesh,
                          in_specs=(None, P("data"), P("data"), P()))


def train(steps: int = 30, batch: int = 16, seq: int = 32, vocab: int = 128,
          log_every: int = 5, verbose: bool = True, num_experts: int = 0):
  """Train on a 2x4 mesh (4x2 with ``num_experts``: MoE every other block);
  returns (losses, partitioned step, final state)."""
  mesh = gshard.make_mesh((4, 2) if num_experts else (2, 4), ("data", "model"))
  graphdef, state = create(vocab=vocab, num_experts=num_experts)
  step = partitioned_step(graphdef, mesh)
  losses = []
  key = jax.random.PRNGKey(42)
  t0 = time.perf_counter()
  for i in range(steps):
    key, sub = jax.random.split(key)
    tokens, targets = models.synthetic_batch(sub, batch, seq, vocab)
    state, loss = step(state, tokens, targets, i)
    losses.append(float(loss))
    if verbose and (i % log_every == 0 or i == steps - 1):
      print(f"  step {i:3d}  loss {losses[-1]:.4f}")
  if verbose:
    print(f"  {steps} steps in {time.perf_counter() - t0:.1f} s (the first includes "
          "tracing, propagation, partitioning and compilation)")
  return losses, step, state


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--moe", action="store_true",
                      help="every other feed-forward block a GShard MoE (mesh 4x2)")
  parser.add_argument("--experts", type=int, default=8, help="experts per MoE block")
  args = parser.parse_args()
  num_experts = args.experts if args.moe else 0
  shape = "data=4 x model=2" if num_experts else "data=2 x model=4"
  kind = f", MoE of {num_experts} experts every other block" if num_experts else ""
  print(f"gshard + Flax NNX: Transformer LM{kind}, AdamW, mesh {shape} "
        f"({jax.device_count()} simulated CPU devices)")
  losses, step, state = train(num_experts=num_experts)
  print(f"  loss {losses[0]:.3f} -> {losses[-1]:.3f}")
  tokens, targets = models.synthetic_batch(jax.random.PRNGKey(0), 16, 32, 128)
  print()
  print(gshard.coverage(step.fn, state, tokens, targets, 0,
                        mesh=step.mesh, in_specs=step.in_specs))
  print()
  print(step.lower(state, tokens, targets, 0).explain(top=6))


if __name__ == "__main__":
  main()
