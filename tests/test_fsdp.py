"""Sharded workers (``intra_worker="fsdp"``): FSDP2 inside a worker, shard-to-shard exchanges between workers.

Two workers of two ranks each, on real gloo process groups (forked, one torch thread per rank). The sharded
run must follow the DDP-inside-a-worker run (the same math in another reduction order), while each rank holds
and sends 1/k of the model.
"""

from __future__ import annotations

import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from dist_utils import SaveAt, TinyRegressor
from gasloc_lightning import DiLoCoStrategy, GASLoCStrategy
from gasloc_lightning.comm.transport import ring_all_reduce_bytes
from gasloc_lightning.plugins.per_rank import export_consensus
from gasloc_lightning.network import NetworkModel
from gasloc_lightning.models.sharding import is_sharded, shard_by_block

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

K = 2  # ranks per worker
WORLD = 4  # two workers


class ShardedRegressor(TinyRegressor):
    """TinyRegressor that shards itself by layer when the strategy hands it a device mesh."""

    def configure_model(self):
        if self.device_mesh is None or is_sharded(self):
            return
        shard_by_block(self.net, [layer for layer in self.net if isinstance(layer, torch.nn.Linear)], self.device_mesh)


class EvenRegressor(ShardedRegressor):
    """Every parameter's first dimension divisible by k and no buffers: each shard is exactly 1/k of the model."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        torch.manual_seed(4321)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))

    def forward(self, x):
        return self.net(x).mean(dim=1, keepdim=True)  # (B, 1)


def _numel(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() if value.dim() > 0 else 0  # scalars (step counters) are not model-size state
    if isinstance(value, dict):
        return sum(_numel(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_numel(v) for v in value)
    return 0


class RecordRun(Callback):
    """Every rank saves its worker's whole replica (gathered), and what it holds and sent, before the end-of-fit
    average."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir

    def on_train_end(self, trainer, pl_module):
        strategy = trainer.strategy
        state = strategy.full_state_dict()
        # BatchNorm statistics differ by design: DDP broadcasts the leader's, a sharded worker keeps each rank's
        params = {k: v.detach().clone() for k, v in state.items() if "running" not in k and "num_batches" not in k}
        record = {
            "params": params,
            "round_index": strategy.round_index,
            "bytes_sent": strategy.bytes_sent,
            "message_numel": strategy.layout.numel,
            "parameter_numel": strategy.layout.num_parameter_elements,
            "optimizer_numel": _numel(strategy.optimizer_state(trainer.optimizers[0])["state"]),
            "outer_numel": _numel(strategy.strategy_state_dict().get("outer")),
            "optimizer_state": strategy.optimizer_state(trainer.optimizers[0])["state"],
            "outer": strategy.strategy_state_dict().get("outer"),
            "strategy": {k: v for k, v in strategy.strategy_state_dict().items() if k not in ("outer", "counters")},
            "global_step": trainer.global_step,
            "sim_time": strategy.sim_time,
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")},
        }
        torch.save(record, Path(self.out_dir) / f"rank{trainer.global_rank}.pt")


def _fit(strategy, out: Path, max_steps: int = 9, callbacks=(), model=None, ckpt_path=None, devices=WORLD,
         **trainer_kwargs):
    out.mkdir(parents=True, exist_ok=True)
    trainer_kwargs.setdefault("enable_checkpointing", False)
    trainer_kwargs.setdefault("limit_val_batches", 0)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=max_steps, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                         default_root_dir=out, callbacks=[RecordRun(str(out)), *callbacks],
                         **trainer_kwargs)
    trainer.fit(model or ShardedRegressor(), ckpt_path=ckpt_path)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(devices)]


def _network():
    return NetworkModel.uniform(world_size=WORLD // K, bandwidth_gbps=10, latency_s=0.0)


CASES = {  # the even model checks the 1/k figures exactly; the BatchNorm one, uneven shards and buffers
    "gasloc_one_peer": (GASLoCStrategy, {"topology": "one_peer", "outer_lr": 0.7, "outer_momentum": 0.5}, EvenRegressor),
    "gasloc_ring": (GASLoCStrategy, {"topology": "ring", "outer_lr": 0.7, "outer_momentum": 0.5}, ShardedRegressor),
    "gasloc_ring_overlap_bf16": (GASLoCStrategy, {"topology": "ring", "outer_lr": 0.7, "outer_momentum": 0.5,
                                                  "overlap": True, "message_codec": "bfloat16"}, ShardedRegressor),
    "diloco": (DiLoCoStrategy, {"outer_lr": 0.7, "outer_momentum": 0.9}, EvenRegressor),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_sharded_workers_follow_ddp_workers_and_hold_a_kth(tmp_path, fresh_port, case):
    """3 rounds of 2 workers x 2 ranks: every parameter of the sharded run within 1e-5 of the DDP run; each rank
    of a sharded worker holds and sends 1/k of the parameters, of their optimizer state and of the outer state.
    With a network model, a sharded worker's exchange takes 1/k the time (k links at once); validation on the
    consensus and each replica's own loss agree."""
    cls, hyper, model = CASES[case]
    with_network = case == "gasloc_one_peer"
    runs = {}
    for intra_worker in ("ddp", "fsdp"):
        fresh_port()
        strategy = cls(inner_steps=3, ranks_per_worker=K, intra_worker=intra_worker, start_method="fork",
                       gossip_timeout=120.0, consensus_every=0, network=_network() if with_network else None, **hyper)
        validation = {"limit_val_batches": 2, "val_check_interval": 4, "num_sanity_val_steps": 0} if with_network else {}
        runs[intra_worker] = _fit(strategy, tmp_path / intra_worker, model=model(), **validation)
    for ddp, fsdp in zip(runs["ddp"], runs["fsdp"]):
        assert ddp["round_index"] == fsdp["round_index"] == 3
        assert ddp["params"].keys() == fsdp["params"].keys()
        for name, reference in ddp["params"].items():
            scale = reference.norm().clamp_min(1e-3)
            assert (fsdp["params"][name] - reference).norm() <= 1e-5 * scale, name
    if with_network:  # 9 steps of 0.5 s on both; the exchanges over k links take half the time
        ddp_comm, fsdp_comm = runs["ddp"][0]["sim_time"] - 4.5, runs["fsdp"][0]["sim_time"] - 4.5
        assert ddp_comm > 0 and fsdp_comm == pytest.approx(ddp_comm / K, rel=1e-9)
        ddp_metrics, fsdp_metrics = runs["ddp"][0]["metrics"], runs["fsdp"][0]["metrics"]
        for name in ("val/loss", "val/loss_local"):
            assert fsdp_metrics[name] == pytest.approx(ddp_metrics[name], rel=1e-5), name
        assert fsdp_metrics["val/loss"] != pytest.approx(fsdp_metrics["val/loss_local"], rel=1e-6)
    whole, shards = runs["ddp"][0], runs["fsdp"][:K]
    assert sum(s["parameter_numel"] for s in shards) == whole["parameter_numel"]  # the shards add up to a replica
    if model is not EvenRegressor:
        return
    for shard in shards:
        for key in ("parameter_numel", "optimizer_numel", "outer_numel"):
            assert shard[key] * K == whole[key] > 0, key
    # a worker's bytes per round, over one link (DDP inside) or k links (FSDP inside): each link carries 1/k
    if cls is GASLoCStrategy:
        worker_bytes = whole["bytes_sent"]  # the DDP worker's leader sends for everyone
        assert runs["ddp"][1]["bytes_sent"] == 0
    else:  # an all-reduce of the worker's mean pseudo-gradient over the 2 workers
        worker_bytes = 3 * ring_all_reduce_bytes(whole["message_numel"] * 4, 2)
    assert [s["bytes_sent"] * K for s in shards] == [worker_bytes] * K


def _assert_equal(expected, actual, where):
    if isinstance(expected, torch.Tensor):
        assert torch.equal(expected, actual), where
    elif isinstance(expected, dict):
        assert expected.keys() == actual.keys(), where
        for key in expected:
            _assert_equal(expected[key], actual[key], f"{where}[{key!r}]")
    else:
        assert expected == actual, where


def test_sharded_run_resumes_exactly_and_exports_the_whole_consensus(tmp_path, fresh_port):
    """8 steps straight == 4 steps, a per-rank checkpoint (each rank its shards, its outer-state shard and its error
    feedback copies), 4 resumed steps: bitwise, on every rank. gasloc-export puts each worker's shards together and averages the workers."""
    def strategy():
        return GASLoCStrategy(inner_steps=2, ranks_per_worker=K, intra_worker="fsdp", topology="ring",
                              message_codec="int8", error_feedback=True,  # per-edge public copies, per shard
                              start_method="fork", gossip_timeout=120.0, consensus_every=0)

    full = _fit(strategy(), tmp_path / "full", max_steps=8, model=EvenRegressor(batches=4))
    fresh_port()
    saved = _fit(strategy(), tmp_path / "first", max_steps=4, model=EvenRegressor(batches=4),
                 callbacks=[SaveAt(4, str(tmp_path / "ck"))])
    fresh_port()
    model = EvenRegressor(batches=4)
    with torch.no_grad():  # everything must come from the checkpoint
        for parameter in model.parameters():
            parameter.add_(1.0)
    resumed = _fit(strategy(), tmp_path / "resumed", max_steps=8, model=model, ckpt_path=str(tmp_path / "ck"))
    for rank, (a, b) in enumerate(zip(full, resumed)):
        assert a["global_step"] == b["global_step"] == 8
        for key in ("params", "optimizer_state", "outer", "strategy"):
            _assert_equal(a[key], b[key], f"rank {rank} {key}")
    report = export_consensus(tmp_path / "ck", tmp_path / "consensus.ckpt")
    assert report["replicas"] == WORLD // K
    exported = torch.load(tmp_path / "consensus.ckpt", weights_only=True)["state_dict"]
    workers = [saved[0]["params"], saved[K]["params"]]  # each worker's whole replica at the save
    assert exported.keys() == workers[0].keys()
    for name, value in exported.items():
        assert torch.allclose(value, (workers[0][name] + workers[1][name]) / 2, atol=1e-7), name
    assert not torch.equal(workers[0]["net.0.weight"], workers[1]["net.0.weight"])  # an average, not a copy
    fresh_port()  # shards do not resume a run whose ranks hold whole replicas
    ddp = GASLoCStrategy(inner_steps=2, ranks_per_worker=K, topology="ring", message_codec="int8", error_feedback=True,
                         start_method="fork", gossip_timeout=30.0, consensus_every=0)
    with pytest.raises(Exception, match="saved with intra_worker='fsdp', this run has intra_worker='ddp'"):
        _fit(ddp, tmp_path / "ddp", max_steps=8, model=EvenRegressor(batches=4), ckpt_path=str(tmp_path / "ck"))


def _elastic_strategy(**kwargs):
    from gasloc_lightning.strategies.elastic import ElasticGASLoCStrategy

    return ElasticGASLoCStrategy(lighthouse="127.0.0.1:29510", worker_id=0, **kwargs)


@pytest.mark.parametrize("build, message", [
    (lambda: GASLoCStrategy(intra_worker="fsdp"), "ranks_per_worker > 1"),
    (lambda: GASLoCStrategy(ranks_per_worker=2, intra_worker="zero"), "intra_worker"),
    (lambda: DiLoCoStrategy(ranks_per_worker=2, intra_worker="fsdp", worker_ddp_kwargs={"bucket_cap_mb": 1}),
     "worker_ddp_kwargs"),
    # fragments stream on shards; DDP inside a worker still refuses them, pointing at the sharded path
    (lambda: GASLoCStrategy(ranks_per_worker=2, fragments=2).check_configuration(4), "intra_worker='fsdp'"),
    (lambda: DiLoCoStrategy(ranks_per_worker=2, overlap=True).check_configuration(4), "intra_worker='fsdp'"),
    (lambda: _elastic_strategy(intra_worker="fsdp"), "elastic mode"),
])
def test_what_sharded_workers_do_not_support_is_refused_by_name(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_validate_after_a_sharded_fit_evaluates_the_consensus_it_returned(tmp_path, fresh_port):
    """Fork hands the launching process the whole consensus model (not rank 0's shard); a later
    ``trainer.validate`` shards it again and scores it as the fit's last validation did."""
    strategy = GASLoCStrategy(inner_steps=3, ranks_per_worker=K, intra_worker="fsdp", topology="one_peer",
                              start_method="fork", gossip_timeout=120.0)
    model = EvenRegressor(batches=3)  # one epoch = one round, validated at its end
    trainer = pl.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=3, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                         enable_checkpointing=False, limit_val_batches=2, num_sanity_val_steps=0,
                         default_root_dir=tmp_path)
    trainer.fit(model)
    fitted = float(trainer.callback_metrics["val/loss"])
    assert not any(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())
    fresh_port()
    validated = trainer.validate(model, verbose=False)[0]["val/loss"]
    assert validated == pytest.approx(fitted, rel=1e-6)


class CheckShardedByBlock(Callback):
    """Every rank records which of the language model's modules FSDP2 shards as units of their own."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir

    def on_train_end(self, trainer, pl_module):
        from torch.distributed.fsdp import FSDPModule

        network = pl_module.model
        record = {"blocks": [isinstance(block, FSDPModule) for block in network.shard_blocks()],
                  "root": isinstance(network, FSDPModule),
                  "all_sharded": all(isinstance(p, torch.distributed.tensor.DTensor) for p in network.parameters()),
                  "loss": float(trainer.callback_metrics["train/loss"])}
        torch.save(record, Path(self.out_dir) / f"blocks{trainer.global_rank}.pt")


@pytest.mark.parametrize("network", ["gpt", "llama"])
def test_the_apps_language_models_shard_by_block(tmp_path, fresh_port, network):
    from dist_utils import write_text_corpus
    from gasloc_lightning.data import ByteDataModule
    from gasloc_lightning.models import HFCausalLMConfig, LanguageModel

    if network == "llama":
        pytest.importorskip("transformers")
        config = HFCausalLMConfig(model_type="llama", block_size=16, overrides={
            "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 1, "max_position_embeddings": 16, "tie_word_embeddings": True})
    else:
        config = {"block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 16}
    data = ByteDataModule(source=write_text_corpus(tmp_path / "corpus"), block_size=16, batch_size=4,
                          cache_dir=tmp_path / "cache", samples_per_epoch=16, val_fraction=0.2)
    strategy = GASLoCStrategy(inner_steps=2, ranks_per_worker=K, intra_worker="fsdp", start_method="fork",
                              gossip_timeout=120.0)
    trainer = pl.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=4, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         use_distributed_sampler=False, limit_val_batches=0, default_root_dir=tmp_path,
                         callbacks=[CheckShardedByBlock(str(tmp_path))])
    trainer.fit(LanguageModel(model=config), data)
    for rank in range(WORLD):
        record = torch.load(tmp_path / f"blocks{rank}.pt", weights_only=True)
        assert record["blocks"] == [True, True] and record["root"] and record["all_sharded"]
        assert math.isfinite(record["loss"])


class WorkerDataRegressor(EvenRegressor):
    """Every rank of a worker reads the worker's data: a worker of k ranks then takes the steps of a worker of one."""

    def __init__(self, ranks_per_worker: int = 1, **kwargs):
        super().__init__(**kwargs)
        self.ranks_per_worker = ranks_per_worker

    def _data(self, split_seed: int):
        worker = self.global_rank // self.ranks_per_worker
        generator = torch.Generator().manual_seed(split_seed * 100 + worker)
        x = torch.randn(self.hparams.batches * 4, 8, generator=generator)
        y = x.sum(dim=1, keepdim=True) * (1 + worker) + 0.1 * torch.randn(len(x), 1, generator=generator)
        return torch.utils.data.TensorDataset(x, y)


@pytest.mark.parametrize("cls", [GASLoCStrategy, DiLoCoStrategy], ids=["gasloc", "diloco"])
def test_streamed_fragments_of_sharded_workers_equal_one_rank_workers(tmp_path, fresh_port, cls):
    """Fragments (F = 2, tau = 1) on shards: each rank streams its shard's fragments, cut between the same
    parameters as the whole model's. With the worker's data on each of its ranks, 2 workers x 2 ranks follow
    2 workers x 1 rank, and each shard's link carries half of the worker's bytes."""
    hyper = {"inner_steps": 4, "fragments": 2, "fragment_sync_delay": 1, "start_method": "fork",
             "gossip_timeout": 120.0, "consensus_every": 0, "outer_lr": 0.7, "outer_momentum": 0.5}
    if cls is GASLoCStrategy:
        hyper["topology"] = "one_peer"
    fresh_port()
    sharded = _fit(cls(ranks_per_worker=K, intra_worker="fsdp", **hyper), tmp_path / "sharded", max_steps=8,
                   model=WorkerDataRegressor(ranks_per_worker=K))
    fresh_port()
    single = _fit(cls(**hyper), tmp_path / "single", max_steps=8, model=WorkerDataRegressor(), devices=WORLD // K)
    for rank, shard in enumerate(sharded):
        whole = single[rank // K]
        for name, reference in whole["params"].items():
            assert (shard["params"][name] - reference).norm() <= 1e-6 * reference.norm().clamp_min(1e-3), name
        assert shard["bytes_sent"] * K == whole["bytes_sent"] > 0


def test_a_checkpoint_in_the_middle_of_a_sharded_fit_leaves_the_training_as_it_was(tmp_path, fresh_port):
    """Saving reads the optimizer state; it must not replace the live DTensor state by plain copies (the next
    step would mix DTensor parameters with plain state, and a second save would lose the shards' names)."""
    def strategy():
        return GASLoCStrategy(inner_steps=2, ranks_per_worker=K, intra_worker="fsdp", topology="ring",
                              start_method="fork", gossip_timeout=120.0, consensus_every=0)

    plain = _fit(strategy(), tmp_path / "plain", max_steps=6, model=EvenRegressor(batches=6))
    fresh_port()
    saving = _fit(strategy(), tmp_path / "saving", max_steps=6, model=EvenRegressor(batches=6),
                  callbacks=[SaveAt(2, str(tmp_path / "ck2")), SaveAt(4, str(tmp_path / "ck4"))])
    for rank, (a, b) in enumerate(zip(plain, saving)):
        for key in ("params", "optimizer_state", "outer"):
            _assert_equal(a[key], b[key], f"rank {rank} {key}")
    for step in (2, 4):  # every save names the sharded optimizer entries
        state = torch.load(tmp_path / f"ck{step}" / "rank_0.ckpt", weights_only=True)
        assert state["optimizer_states"][0]["sharded_keys"], step


class PartlyShardedRegressor(TinyRegressor):
    """Shards its Linear layers only: the BatchNorm's weight and bias stay plain, trained apart on each rank."""

    def configure_model(self):
        if self.device_mesh is not None and not is_sharded(self):
            for layer in self.net:
                if isinstance(layer, torch.nn.Linear):
                    torch.distributed.fsdp.fully_shard(layer, mesh=self.device_mesh["shards"])


class HSDPRegressor(TinyRegressor):
    """Shards over the whole (workers, shards) mesh: FSDP2 would all-reduce gradients across workers (HSDP)."""

    def configure_model(self):
        if self.device_mesh is not None and not is_sharded(self):
            torch.distributed.fsdp.fully_shard(self.net, mesh=self.device_mesh)


class UnshardedRegressor(TinyRegressor):
    def configure_model(self):
        pass


@pytest.mark.parametrize("model, message", [
    (UnshardedRegressor, "no sharded parameter"),
    (PartlyShardedRegressor, r"\['net.1.weight', 'net.1.bias'\] are not sharded"),
    (HSDPRegressor, "over this worker's ranks"),
], ids=["unsharded", "partly", "hsdp"])
def test_a_module_sharded_other_than_over_the_workers_ranks_is_refused(tmp_path, fresh_port, model, message):
    strategy = GASLoCStrategy(inner_steps=2, ranks_per_worker=K, intra_worker="fsdp", start_method="fork",
                              gossip_timeout=30.0)
    with pytest.raises(Exception, match=message):
        _fit(strategy, tmp_path, max_steps=2, model=model())


def _sharded_directory(directory: Path, shards: list, states: list) -> Path:
    """A per-rank checkpoint directory written by hand: rank r's ``gasloc["shards"]`` and ``state_dict``."""
    import json

    directory.mkdir()
    (directory / "meta.json").write_text(json.dumps({"format": "gasloc-per-rank-v2", "world_size": len(states),
                                                     "global_step": 1, "save_id": 7}))
    torch.save({"global_step": 1, "gasloc": {"save_id": 7}}, directory / "shared.ckpt")
    for rank, (described, state) in enumerate(zip(shards, states)):
        gasloc = {"save_id": 7, "rank": rank, **({} if described is None else {"shards": described})}
        torch.save({"state_dict": state, "gasloc": gasloc}, directory / f"rank_{rank}.ckpt")
    return directory


def _shard(index, count=2, sharded=("w",)):
    return {"index": index, "count": count, "sharded": list(sharded)}


@pytest.mark.parametrize("shards, states", [
    ([_shard(0, count=0), _shard(1, count=0)], [{"w": torch.ones(1)}] * 2),
    ([_shard(0, count=3), _shard(1, count=3)], [{"w": torch.ones(1)}] * 2),
    ([_shard(0), None], [{"w": torch.ones(1)}] * 2),
    ([_shard(0), _shard(1, count=1)], [{"w": torch.ones(1)}] * 2),
    ([_shard(0), _shard(1)], [{"w": torch.ones(1)}, {"v": torch.ones(1)}]),
    ([_shard(0), _shard(1)], [{"w": torch.ones(1, 2)}, {"w": torch.ones(1, 3)}]),
    ([_shard(0), _shard(1)], [{"w": torch.ones(())}, {"w": torch.ones(())}]),
], ids=["count0", "count_not_dividing", "mixed", "counts_differ", "names_differ", "shapes", "scalar"])
def test_export_of_malformed_shard_files_is_a_format_error(tmp_path, shards, states):
    from gasloc_lightning.plugins.per_rank import CheckpointFormatError

    directory = _sharded_directory(tmp_path / "ck", shards, states)
    with pytest.raises(CheckpointFormatError):
        export_consensus(directory, tmp_path / "out.ckpt")


def test_export_puts_uneven_shards_together(tmp_path):
    """k = 2 shards of a 3-row tensor (2 rows and 1, as torch.chunk) and an unsharded entry from shard 0."""
    whole = torch.arange(6.0).reshape(3, 2)
    directory = _sharded_directory(tmp_path / "ck", [_shard(0), _shard(1)],
                                   [{"w": whole[:2], "b": torch.zeros(1)}, {"w": whole[2:], "b": torch.ones(1)}])
    report = export_consensus(directory, tmp_path / "out.ckpt")
    exported = torch.load(tmp_path / "out.ckpt", weights_only=True)["state_dict"]
    assert report["replicas"] == 1 and torch.equal(exported["w"], whole) and torch.equal(exported["b"], torch.zeros(1))


def test_loading_local_state_reshards_fsdp_modules_only():
    """A user module with a method named ``reshard`` (not FSDP2's) is not called by a load."""
    from gasloc_lightning.strategies.sharded_state import load_local_module_state

    class Custom(torch.nn.Linear):
        def reshard(self, factor):  # the user's own meaning
            raise AssertionError("called")

    module = torch.nn.Sequential(Custom(2, 2))
    state = {name: torch.zeros_like(value) for name, value in module.state_dict().items()}
    load_local_module_state(module, state)
    assert all(torch.equal(value, torch.zeros_like(value)) for value in module.state_dict().values())


@pytest.mark.parametrize("start_method", ["spawn", "fork", "forkserver"])
def test_every_multiprocessing_start_method_hands_back_the_whole_model(start_method):
    """Lightning's multiprocessing launcher serves spawn, fork and forkserver alike: each must be the sharded one,
    or rank 0 returns its shard's DTensors, which the launching process cannot load, at the end of the fit."""
    from gasloc_lightning.strategies.launcher import ShardedResultsLauncher

    strategy = GASLoCStrategy(ranks_per_worker=K, intra_worker="fsdp", start_method=start_method)
    trainer = pl.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)
    assert isinstance(trainer.strategy.launcher, ShardedResultsLauncher)
