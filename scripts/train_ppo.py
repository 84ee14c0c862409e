"""A short PPO on CartPole-v1, collecting through an async env pool.

The env pool is the only moving part: ``--backend zmqpool`` (the default) uses
:class:`zmqpool.ZMQAsyncEnvPool`, ``--backend torchrl`` uses torchrl's own
``AsyncEnvPool(backend="multiprocessing", exchange="shm")``. Everything else is
stock torchrl: a ``Collector`` over the pool, ``GAE`` + ``ClipPPOLoss``, a
``ReplayBuffer`` with ``SamplerWithoutReplacement``, and small MLPs for the
actor (``ProbabilisticActor`` over ``OneHotCategorical``) and the critic.

Run it from the repository root::

    python scripts/train_ppo.py                      # zmqpool, 4 envs, full run
    python scripts/train_ppo.py --backend torchrl    # same run on torchrl's pool
    python scripts/train_ppo.py --quick              # tiny smoke run (< 60 s)
    python scripts/train_ppo.py --frames 60000 --num-envs 4 --seed 1

It prints one line per collected batch (iteration, frames, mean return of the
episodes that ended in that batch, loss) and ends with the summary line
``first_return=<float> last_return=<float>``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from dataclasses import dataclass, replace

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModule, TensorDictSequential
from torch import nn
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.data.replay_buffers.samplers import SamplerWithoutReplacement
from torchrl.envs import Compose, EnvBase, GymEnv, RewardSum, StepCounter, TransformedEnv
from torchrl.modules import MLP, OneHotCategorical, ProbabilisticActor, ValueOperator
from torchrl.objectives import ClipPPOLoss
from torchrl.objectives.value import GAE

BACKENDS = ("zmqpool", "torchrl")
SOLVED = 150.0  # the mean episode return reported as a milestone
ENV_INDEX = "env_index"  # the key AsyncEnvPool adds to route data to its envs


@dataclass(frozen=True)
class Config:
    """Run sizes and PPO hyper-parameters."""

    frames: int = 50_000
    num_envs: int = 4
    frames_per_batch: int = 1_000
    backend: str = "zmqpool"
    seed: int = 0
    epochs: int = 10
    minibatch_size: int = 250
    lr: float = 1e-3
    gamma: float = 0.99
    lmbda: float = 0.95
    clip_epsilon: float = 0.2
    entropy_coeff: float = 0.01
    max_grad_norm: float = 0.5
    hidden: int = 64


QUICK = {"frames": 2_000, "frames_per_batch": 500, "epochs": 2, "minibatch_size": 125}


def _add_size(parser: argparse.ArgumentParser, field: str, what: str, default: Config) -> None:
    """A size ``--quick`` shrinks: unset, the default's or QUICK's, as the help says."""
    parser.add_argument(
        f"--{field.replace('_', '-')}",
        type=int,
        default=None,
        help=f"{what} (unset: {getattr(default, field):,}, {QUICK[field]:,} with --quick)",
    )


def parse_args(argv: list[str] | None = None) -> Config:
    """Parse the command line into a :class:`Config` (``--quick`` shrinks the sizes)."""
    default = Config()
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n", 1)[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_size(parser, "frames", "total env frames to collect", default)
    parser.add_argument(
        "--num-envs", type=int, default=default.num_envs, help="envs in the pool, >= 1"
    )
    _add_size(parser, "frames_per_batch", "env frames per collected batch", default)
    parser.add_argument(
        "--backend", choices=BACKENDS, default=default.backend, help="the env pool to collect from"
    )
    parser.add_argument(
        "--seed", type=int, default=default.seed, help="torch's and the pool's seed"
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes for a smoke test")
    args = parser.parse_args(argv)
    sizes = dict(QUICK) if args.quick else {}
    if args.frames is not None:
        sizes["frames"] = args.frames
    if args.frames_per_batch is not None:
        sizes["frames_per_batch"] = args.frames_per_batch
    cfg = Config(num_envs=args.num_envs, backend=args.backend, seed=args.seed, **sizes)
    if min(cfg.frames, cfg.num_envs, cfg.frames_per_batch) < 1:
        parser.error("--frames, --num-envs and --frames-per-batch must be positive")
    # A minibatch larger than the batch would mean no gradient step at all.
    return replace(cfg, minibatch_size=min(cfg.minibatch_size, cfg.frames_per_batch))


def make_cartpole(seed: int | None = None) -> EnvBase:
    """One CartPole env with a step counter and an episode-return tracker.

    Top-level (picklable) so that spawned pool workers can build it.
    """
    env = TransformedEnv(GymEnv("CartPole-v1"), Compose(StepCounter(), RewardSum()))
    if seed is not None:
        env.set_seed(seed)
    return env


def make_env(num_envs: int, backend: str = "zmqpool", seed: int | None = None) -> EnvBase:
    """A pool of ``num_envs`` CartPole envs, env ``i`` seeded with ``seed + i``."""
    makers = [make_cartpole] * num_envs
    kwargs = [{"seed": None if seed is None else seed + i} for i in range(num_envs)]
    if backend == "zmqpool":
        from zmqpool import ZMQAsyncEnvPool

        return ZMQAsyncEnvPool(makers, create_env_kwargs=kwargs)
    if backend == "torchrl":
        from torchrl.envs import AsyncEnvPool

        return AsyncEnvPool(
            makers, backend="multiprocessing", exchange="shm", create_env_kwargs=kwargs
        )
    raise ValueError(f"unknown backend {backend!r}, expected one of {BACKENDS}")


def seed_everything(env: EnvBase, seed: int) -> None:
    """Seed torch and the pool; torchrl's AsyncEnvPool has no ``set_seed``.

    Its envs are still seeded: :func:`make_env` passes each maker its own seed.
    """
    torch.manual_seed(seed)
    with contextlib.suppress(NotImplementedError):
        env.set_seed(seed)


def make_actor_critic(env: EnvBase, hidden: int) -> tuple[ProbabilisticActor, ValueOperator]:
    """An MLP policy over one-hot actions and an MLP state-value net."""
    obs_dim = env.observation_spec["observation"].shape[-1]
    num_actions = env.action_spec.shape[-1]
    logits = MLP(in_features=obs_dim, out_features=num_actions, num_cells=[hidden, hidden])
    actor = ProbabilisticActor(
        TensorDictModule(logits, in_keys=["observation"], out_keys=["logits"]),
        in_keys=["logits"],
        spec=env.action_spec_unbatched,
        distribution_class=OneHotCategorical,
        return_log_prob=True,
    )
    value = MLP(in_features=obs_dim, out_features=1, num_cells=[hidden, hidden])
    critic = ValueOperator(value, in_keys=["observation"])
    return actor, critic


def make_collector(env: EnvBase, actor: ProbabilisticActor, cfg: Config) -> Collector:
    """A synchronous collector over the pool, acting with ``actor``.

    Three AsyncEnvPool pitfalls are avoided here:

    - the collector hands the env the whole carrier, policy outputs included, and
      a shared-memory pool has a fixed input schema that refuses unknown keys
      (``logits``, ``action_log_prob``): so the behaviour policy writes only the
      action, and :func:`add_log_prob` recomputes the log-probabilities later;
    - for the same reason, ``track_traj_ids=False`` (no ``("collector", "traj_ids")``);
    - ``use_buffers=False``: ``env_index`` is a NonTensorStack after ``reset`` but a
      tensor after ``step``, which breaks the preallocated rollout buffers.
    """
    behaviour = TensorDictSequential(actor, selected_out_keys=["action"])
    return Collector(
        env,
        behaviour,
        frames_per_batch=cfg.frames_per_batch,
        total_frames=cfg.frames,
        split_trajs=False,
        track_traj_ids=False,
        use_buffers=False,
        auto_register_policy_transforms=False,
    )


def add_log_prob(batch: TensorDictBase, actor: ProbabilisticActor, key: str) -> None:
    """Write the log-probability of the collected actions under ``actor`` into ``batch``.

    PPO needs the behaviour policy's log-probabilities; the actor's weights have not
    changed since the batch was collected, so recomputing them gives the same values.
    """
    with torch.no_grad():
        batch.set(key, actor.get_dist(batch).log_prob(batch["action"]))


def episode_returns(batch: TensorDictBase) -> torch.Tensor:
    """The returns of the episodes that ended in ``batch`` (possibly none)."""
    return batch["next", "episode_reward"][batch["next", "done"]]


@dataclass
class PPO:
    """The learner: actor, clipped-PPO loss, GAE, optimizer and minibatch buffer."""

    actor: ProbabilisticActor
    loss_module: ClipPPOLoss
    gae: GAE
    optimizer: torch.optim.Optimizer
    buffer: ReplayBuffer
    cfg: Config

    def update(self, batch: TensorDictBase) -> float:
        """Run ``cfg.epochs`` epochs of clipped PPO on one batch; return the mean loss."""
        cfg = self.cfg
        add_log_prob(batch, self.actor, self.loss_module.tensor_keys.sample_log_prob)
        total, count = 0.0, 0
        for _ in range(cfg.epochs):
            with torch.no_grad():
                self.gae(batch)
            self.buffer.extend(batch.reshape(-1))
            for _ in range(len(self.buffer) // cfg.minibatch_size):
                losses = self.loss_module(self.buffer.sample(cfg.minibatch_size))
                loss = losses["loss_objective"] + losses["loss_critic"] + losses["loss_entropy"]
                self.optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(self.loss_module.parameters(), cfg.max_grad_norm)
                self.optimizer.step()
                total += loss.item()
                count += 1
        return total / max(count, 1)


def make_ppo(env: EnvBase, cfg: Config) -> PPO:
    """Build the actor-critic and everything PPO needs around it."""
    actor, critic = make_actor_critic(env, cfg.hidden)
    loss_module = ClipPPOLoss(
        actor,
        critic,
        clip_epsilon=cfg.clip_epsilon,
        entropy_coeff=cfg.entropy_coeff,
        critic_coeff=0.5,
        loss_critic_type="l2",
        normalize_advantage=True,
    )
    return PPO(
        actor=actor,
        loss_module=loss_module,
        gae=GAE(gamma=cfg.gamma, lmbda=cfg.lmbda, value_network=critic),
        optimizer=torch.optim.Adam(loss_module.parameters(), lr=cfg.lr),
        buffer=ReplayBuffer(
            storage=LazyTensorStorage(cfg.frames_per_batch),
            sampler=SamplerWithoutReplacement(),
            batch_size=cfg.minibatch_size,
        ),
        cfg=cfg,
    )


def run_loop(collector: Collector, ppo: PPO, start: float) -> list[float]:
    """Collect, update, print a progress line per batch; return the per-batch mean returns.

    A batch in which no episode ended (long episodes, late in training) has no
    return: it prints ``-`` and is left out of the list.
    """
    means: list[float] = []
    frames = 0
    for iteration, batch in enumerate(collector):
        # The pool's bookkeeping key; as a NonTensorStack it makes every buffer op slow.
        batch = batch.exclude(ENV_INDEX)
        frames += batch.numel()
        returns = episode_returns(batch)
        if returns.numel():
            means.append(returns.mean().item())
            if means[-1] > SOLVED and max(means[:-1], default=0.0) <= SOLVED:
                elapsed = time.perf_counter() - start
                print(f"mean return > {SOLVED:g} first reached: frames={frames} t={elapsed:.1f}s")
        loss = ppo.update(batch)
        collector.update_policy_weights_()
        shown = f"{means[-1]:7.1f}" if returns.numel() else f"{'-':>7}"
        print(
            f"iter={iteration:3d} frames={frames:7d} episodes={returns.numel():3d} "
            f"return={shown} loss={loss:8.4f} time={time.perf_counter() - start:6.1f}s",
            flush=True,
        )
    return means


def train(cfg: Config) -> tuple[float, float]:
    """Train; return the first and last finite per-batch mean episode returns."""
    torch.set_num_threads(1)  # tiny MLPs: more threads only contend with the env workers
    start = time.perf_counter()
    env = make_env(cfg.num_envs, cfg.backend, seed=cfg.seed)
    collector = None
    try:
        seed_everything(env, cfg.seed)
        ppo = make_ppo(env, cfg)
        collector = make_collector(env, ppo.actor, cfg)
        elapsed = time.perf_counter() - start
        print(f"backend={cfg.backend} num_envs={cfg.num_envs} pool ready in {elapsed:.1f}s")
        means = run_loop(collector, ppo, start)
    finally:
        # The collector closes the env once total_frames are in, but not on an error.
        # Then ``Collector.shutdown()`` would skip torchrl's AsyncEnvPool (it reports
        # ``is_closed=True`` from the start) and the interpreter would hang at exit
        # joining its live workers: so close the env here, tolerating a second close.
        if collector is not None:
            collector.shutdown(close_env=False)
        env.close(raise_if_closed=False)
    return (means[0], means[-1]) if means else (math.nan, math.nan)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    start = time.perf_counter()
    first, last = train(cfg)
    print(f"wall_time={time.perf_counter() - start:.1f}s")
    print(f"first_return={first:.2f} last_return={last:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
