"""SISA and the game learner on a network of the user's (issue 30), given by import path:
SISA trains, deletes and adds exactly (a retrain from scratch gives the same hash), the
game's exact retrain verifies by hash; the source is pinned and saved with the model,
mistakes are refused at train time with one line, and the vote rule that serves SISA is
sound against brute-force leave-one-out retrains of a CNN.
See docs/learners.md (Your own network)."""

from __future__ import annotations

import copy
import hashlib
import json
import re
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits, make_classification, make_moons

from jobs.guard.label_guard import sisa_certain
from jobs.learners.networks.user_network import SOURCE_FILE, NetworkError
from jobs.learners.sisa.ensemble import SISAEnsemble
from jobs.orchestration.job_settings import JobSettings
from jobs.orchestration.model_commands import training_params, with_network
from jobs.orchestration.registry import manifest
from jobs.orchestration.served_model import (
    NotAsPublished,
    ServedModel,
    ShardVoteModel,
    load_as_published,
)

CNN = "jobs.learners.networks.examples.digits:build"
MLP = "tests.user_networks:dropout_mlp"
RELU = "tests.user_networks:relu_mlp"
TABLES = "jobs.learners.networks.examples.tables:build"
# a small table's ensemble of a user's ReLU MLP, as tests/idp/test_sisa_bounds.py's
RELU_KW = {"n_shards": 3, "network": RELU, "network_params": {"hidden": [8]},
           "epochs_per_slice": 30, "min_steps": 0, "batch_size": 4, "lr": 0.1,
           "device": "cpu", "random_state": 0}
EXAMPLES = Path(__file__).with_name("user_networks.py")
CNN_SOURCE = Path(__file__).parent.parent / "jobs/learners/networks/examples/digits.py"


def _digits(classes: tuple[int, ...] = tuple(range(10))) -> tuple[np.ndarray, np.ndarray]:
    X, y = load_digits(return_X_y=True)
    keep = np.isin(y, classes)
    return (X[keep] / 16.0).astype(np.float32), y[keep]


def _ids(n: int, prefix: str = "r") -> list[str]:
    return [f"{prefix}{i:04d}" for i in range(n)]


def _moons(n: int = 48) -> tuple[np.ndarray, np.ndarray, list[str]]:
    X, y = make_moons(n, noise=0.25, random_state=1)
    X = (X - X.min(0)) / (X.max(0) - X.min(0))
    return X.astype(np.float32), y, _ids(n)


def _table(n: int = 120) -> tuple[np.ndarray, np.ndarray]:
    X, y = make_classification(n_samples=n, n_features=6, n_informative=4, n_classes=3,
                               random_state=3)
    X = (X - X.min(axis=0)) / (X.max(axis=0) - X.min(axis=0))
    return X.astype(np.float32), y


def test_a_user_cnn_trains_deletes_and_adds_exactly() -> None:
    X, y = _digits()
    ids = _ids(240)
    params = {"n_shards": 3, "network": CNN, "network_params": {"channels": 4},
              "epochs_per_slice": 12, "lr": 0.05, "random_state": 7}
    model = SISAEnsemble(**params).fit(X[:240], y[:240], record_ids=ids)
    assert model.network_ == {"path": CNN, "sha256": hashlib.sha256(
        CNN_SOURCE.read_bytes()).hexdigest(), "params": {"channels": 4}}
    assert model.config_["schedule"] == "adam" and model.config_["model"] == "network"
    assert (model.predict(X[1000:1200]) == y[1000:1200]).mean() > 0.4  # it learns (chance: 0.1)
    model.delete(ids[:4])
    model.add(["new0", "new1"], X[300:302], y[300:302])
    assert model.verify().exact
    # the retrain from scratch on the live records, seed and network: the same hash
    fresh = SISAEnsemble(**params).fit(model.X_, model.classes_[model.y_],
                                       record_ids=model.record_ids_)
    assert fresh.content_hash() == model.content_hash()
    # the network is part of the hash: the same weights under other params are not the model
    other = SISAEnsemble(**{**params, "network_params": {"channels": 5}}).fit(
        model.X_, model.classes_[model.y_], record_ids=model.record_ids_)
    assert other.content_hash() != model.content_hash()


def test_a_sliced_user_mlp_with_dropout_and_sgd_stays_exact_through_a_bundle(
        tmp_path: Path) -> None:
    X, y = _table()
    ids = _ids(100)
    model = SISAEnsemble(n_shards=2, n_slices=3, network=MLP, network_params={"hidden": 16},
                         optimizer="sgd", lr=0.1, epochs_per_slice=5,
                         random_state=1).fit(X[:100], y[:100], record_ids=ids)
    model.delete(ids[10:13])
    model.add(_ids(5, "a"), X[100:105], y[100:105])
    assert model.verify().exact
    model.save(tmp_path / "m")
    assert (tmp_path / "m" / SOURCE_FILE).read_bytes() == EXAMPLES.read_bytes()
    loaded = SISAEnsemble.load(tmp_path / "m")
    assert loaded.content_hash() == model.content_hash()
    model.delete([ids[20]])
    loaded.delete([ids[20]])
    assert loaded.content_hash() == model.content_hash() and loaded.verify().exact


def _module(tmp_path: Path, name: str, width_extra: int = 0) -> str:
    (tmp_path / f"{name}.py").write_text(
        "from torch import nn\n\n\n"
        "def build(n_features, n_classes):\n"
        f"    return nn.Sequential(nn.Linear(n_features, 8), nn.ReLU(), "
        f"nn.Linear(8, n_classes + {width_extra}))\n")
    return f"{name}:build"


def test_a_changed_source_is_never_run_under_the_recorded_hash(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    path = _module(tmp_path, f"usernet_changed_{tmp_path.name.replace('-', '_')}")
    X, y = _table(60)
    model = SISAEnsemble(n_shards=2, network=path, epochs_per_slice=3,
                         random_state=2).fit(X, y, record_ids=_ids(60))
    bundle = tmp_path / "bundle"
    model.save(bundle)
    module_file = tmp_path / (path.split(":")[0] + ".py")
    module_file.write_text(module_file.read_text().replace("8", "9"))
    # the saved copy is what runs: the same model, though the installed module changed
    loaded = SISAEnsemble.load(bundle)
    assert loaded.content_hash() == model.content_hash()
    assert (loaded.predict(X) == model.predict(X)).all()
    saved = (bundle / SOURCE_FILE).read_bytes()
    (bundle / SOURCE_FILE).unlink()  # without the copy: the installed one, which changed
    with pytest.raises(NetworkError, match=r"changed since the model was trained"):
        SISAEnsemble.load(bundle)
    (bundle / SOURCE_FILE).write_bytes(saved + b"# edited\n")
    with pytest.raises(NetworkError, match=r"saved source has SHA-256 .* trained with"):
        SISAEnsemble.load(bundle)


@pytest.mark.parametrize(("network", "message"), [
    ("tests.user_networks:wrong_width",
     r"outputs \(2, 4\) for a batch of shape \(2, 6\); the table has 3 classes"),
    ("tests.user_networks:not_a_module", r"build returned list, not a torch.nn.Module"),
    ("tests.user_networks:nondeterministic",
     r"uses put_, which has no deterministic implementation"),
    ("tests.user_networks:no_such_function", r"has no function 'no_such_function'"),
    ("no_such_package.models:build", r"cannot import 'no_such_package.models'"),
    ("tests.user_networks", r"expected an import path 'package.module:function'"),
    (CNN, r"build\(6, 3, \*\*\{\}\) raised ValueError: 6 features are not a square image"),
])
def test_a_network_that_cannot_serve_is_refused_at_train_time(network: str,
                                                              message: str) -> None:
    X, y = _table(30)
    with pytest.raises(NetworkError, match=message) as err:
        SISAEnsemble(network=network).fit(X, y)
    assert "\n" not in str(err.value) and repr(network) in str(err.value)


def test_settings_a_user_network_cannot_take() -> None:
    X, y = _table(30)
    with pytest.raises(ValueError, match=r"schedule='loo' cannot train network "
                       r"'tests.user_networks:dropout_mlp': its layer 2 is a Dropout"):
        SISAEnsemble(network=MLP, schedule="loo").fit(X, y)
    with pytest.raises(ValueError, match=r"cannot train network .*relu_mlp.*: "
                       r"optimizer='adam' \(the schedule is plain SGD\)"):
        SISAEnsemble(network=RELU, schedule="loo", optimizer="adam").fit(X, y)
    with pytest.raises(ValueError, match=r"loss=0.1 \(the schedule's kernels take "
                       r"cross-entropy only\)"):
        SISAEnsemble(network=RELU, schedule="loo", loss=0.1).fit(X, y)
    with pytest.raises(ValueError, match=r"cannot train network .*hooked_relu_mlp.*: it has "
                       r"forward hooks"):
        SISAEnsemble(network="tests.user_networks:hooked_relu_mlp", schedule="loo").fit(X, y)
    with pytest.raises(ValueError, match="optimizer='sgd' needs a network of your own"):
        SISAEnsemble(optimizer="sgd").fit(X, y)
    with pytest.raises(ValueError, match="loss='nll' needs a network of your own"):
        SISAEnsemble(loss="nll").fit(X, y)
    for bad in ("mse", 1.0, -0.1, True):
        with pytest.raises(ValueError, match=r"The 'loss' parameter of SISAEnsemble must be "
                           r"a str among \{.*'cross_entropy'.*\} or a label-smoothing "
                           r"value \(a float in \[0, 1\)\)\. Got"):
            SISAEnsemble(network=MLP, loss=bad).fit(X, y)


@pytest.mark.parametrize("loss", ["nll", 0.1])
def test_the_loss_is_a_parameter_and_stays_exact(loss: str | float) -> None:
    """Label smoothing and NLL (the network gives log-probabilities) train, change the
    bits, and a deletion is still a retrain from scratch."""
    X, y = _table()
    ids = _ids(100)
    net = "tests.user_networks:log_softmax_mlp" if loss == "nll" else MLP
    kw = {"n_shards": 2, "network": net, "epochs_per_slice": 20, "lr": 0.05,
          "random_state": 3}
    model = SISAEnsemble(**kw, loss=loss).fit(X[:100], y[:100], record_ids=ids)
    assert model.config_["loss"] == loss and model.config_["schedule"] == "adam"
    assert "hidden" not in model.config_ and "weight_decay" not in model.config_
    plain = SISAEnsemble(**kw).fit(X[:100], y[:100], record_ids=ids)
    assert plain.config_["loss"] == "cross_entropy"
    assert plain.content_hash() != model.content_hash()
    assert (model.predict(X[:100]) == y[:100]).mean() > 0.55  # it learns (chance: 1/3)
    model.delete(ids[:3])
    assert model.verify().exact


@pytest.mark.parametrize("n_slices", [1, 2])
def test_a_user_relu_mlp_trains_with_the_masked_schedule_from_its_own_weights(
        n_slices: int) -> None:
    """A flat Linear/ReLU Sequential takes the built-in MLP's road: the masked LOO
    schedule (sliced too, when asked for) from the module's own seeded initial weights;
    the LOO set the guard rebuilds for a shard holds the served shard and, for a record,
    the shard after deleting it, bit for bit."""
    from jobs.guard.lucid.shard_bounds import ensemble_loo_set
    from jobs.learners.networks.user_network import UserNetwork

    X, y, ids = _moons()
    sliced = {"n_slices": 2, "schedule": "loo"} if n_slices > 1 else {}
    model = SISAEnsemble(**RELU_KW, **sliced).fit(X, y, record_ids=ids)
    cfg = model.config_
    assert (cfg["schedule"], cfg["hidden"], cfg["optimizer"]) == ("loo", [8], "sgd")
    assert model.bound_obstacle_ is None
    assert list(model.shard_state(0)) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    # the schedule starts from the module's own initialisation, not the built-in one's
    args = model.shard_training_args(0, stage=0)
    own = UserNetwork.resolve(RELU, {"hidden": [8]}).build(2, 2, seed=args["seed"])
    assert np.array_equal(args["init"].weights[0], own[0].weight.detach().numpy())
    for s in range(3):
        loo = ensemble_loo_set(model, s)  # checks its base against the served shard
        assert loo is not None and loo.full().equal(model.shard_params(s))
        rid = loo.record_ids[len(loo.record_ids) // 2]
        after = copy.deepcopy(model)
        after.delete([rid])
        assert loo.loo(rid).equal(after.shard_params(s)), (s, rid)
    assert model.verify().exact


@pytest.mark.parametrize(("extra", "why"), [
    ({"schedule": "adam"}, "it was asked for"),
    ({"n_slices": 2}, "2 slices (schedule='auto' takes the LOO schedule for one)"),
    ({"optimizer": "adam"}, "optimizer='adam' (the schedule is plain SGD)"),
    ({"loss": "nll"}, "loss='nll' (the schedule's kernels take cross-entropy only)")])
def test_why_a_relu_mlp_is_left_to_the_vote_rule(extra: dict, why: str) -> None:
    X, y, ids = _moons()
    model = SISAEnsemble(**{**RELU_KW, "epochs_per_slice": 2, **extra}).fit(
        X, y, record_ids=ids)
    assert model.config_["schedule"] == "adam"
    assert model.bound_obstacle_ == f"network {RELU!r} trains with schedule='adam': {why}"


@pytest.mark.slow  # 48 retrains of three small shards and their bounds: about 20 s
def test_bound_answers_for_a_user_relu_mlp_hold_against_brute_force_retrains() -> None:
    """Every answer the served rule with per-shard bounds calls certain is the answer of
    the ensemble retrained from scratch without any one record; the bounds certify more
    than the vote rule alone."""
    X, y, ids = _moons()
    served = ShardVoteModel(SISAEnsemble(**RELU_KW).fit(X, y, record_ids=ids))
    while not served.guard_complete:
        served.refresh_guard(5.0)
    rec = served.guard_record()
    assert rec["serves"] == "bounds" and rec["bound"]["complete"]
    grid = np.stack(np.meshgrid(np.linspace(0, 1, 12), np.linspace(0, 1, 12)), -1)
    queries = np.concatenate([X, grid.reshape(-1, 2)]).astype(np.float32)
    winner, certain = served.certain(queries)
    ens = served.learner
    _, vote_only = sisa_certain(ens.shard_logits(queries), np.full((3, 2), np.inf),
                                ens.active_shards_)
    assert certain.sum() > vote_only.sum(), (certain.sum(), vote_only.sum())
    for i in range(len(ids)):
        keep = np.arange(len(ids)) != i
        loo = SISAEnsemble(**RELU_KW).fit(X[keep], y[keep], record_ids=np.array(ids)[keep])
        moved = loo.predict(queries) != ens.classes_[winner]
        assert not (moved & certain).any(), f"a certain answer moved without {ids[i]}"
    with pytest.raises(ValueError, match="--network .* needs --learner sisa or game, not 'dare'"):
        with_network("dare", {}, MLP)
    assert with_network("sisa", {"n_shards": 3}, MLP) == {"n_shards": 3, "network": MLP}


def test_the_sidecar_serves_it_under_the_vote_rule_and_holds_it_to_the_manifest(
        tmp_path: Path) -> None:
    X, y = _digits((0, 1, 2))
    ids = np.array(_ids(90), dtype=object)
    model = ServedModel.train("sisa", ids, X[:90], y[:90],
                              {"network": CNN, "epochs_per_slice": 5, "n_shards": 3})
    man = manifest(model, seq=1, parent=None, ledger_seq=0, training_set=(90, "root"),
                   change={"op": "train"})
    assert man["network"]["path"] == CNN and man["params"]["network"] == CNN
    assert man["guard"]["rule"] == "sisa-vote" and man["guard"]["serves"] == "vote"
    assert man["guard"]["why"] == (
        f"no per-shard bounds: network {CNN!r} trains with schedule='adam': its module is a "
        "DigitsCNN, not a torch.nn.Sequential of Linear and ReLU layers; the vote rule "
        "needs none")
    # the hyperparameters it trained under, none it ignores
    assert {"hidden", "model", "weight_decay"}.isdisjoint(man["params"])
    assert {"lr", "optimizer", "loss", "epochs_per_slice"} <= set(man["params"])
    model.save(tmp_path / "v1")
    served = load_as_published(tmp_path / "v1", man)
    assert (served.certain(X[90:120])[0] == model.certain(X[90:120])[0]).all()
    edited = json.loads(json.dumps(man))
    edited["network"]["sha256"] = "0" * 64
    with pytest.raises(NotAsPublished, match="its network's source is"):
        load_as_published(tmp_path / "v1", edited)


def test_the_sidecar_serves_a_user_relu_mlp_with_per_shard_bounds() -> None:
    X, y, ids = _moons()
    model = ServedModel.train("sisa", np.array(ids, dtype=object), X, y,
                              {"network": RELU, "n_shards": 2})
    model.refresh_guard(2.0)
    man = manifest(model, seq=1, parent=None, ledger_seq=0, training_set=(48, "root"),
                   change={"op": "train"})
    guard = man["guard"]
    assert guard["serves"] == "bounds" and guard["shard_bound"] == "per-shard"
    assert any(row["current"] for row in guard["bound"]["shards"])
    assert {"hidden", "model", "optimizer", "loss"}.isdisjoint(man["params"])
    assert model.learner.config_["hidden"] == [16]  # the module's width, in the config


def test_the_device_settings_are_checked_and_reach_shard_training_and_loo_sets(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """OBLIVIATE_DEVICE picks where new models train (their retrains and LOO sets follow
    the model); unset it is `auto`, the CPU path as before. Mistakes are one line each."""
    import torch

    assert JobSettings().training_device() == "auto"
    assert training_params("sisa", {}, None, JobSettings()) == {"device": "auto"}
    monkeypatch.setenv("OBLIVIATE_DEVICE", "cpu")
    monkeypatch.setenv("OBLIVIATE_CUDA_MEMORY_FRACTION", "0.5")  # no CUDA: nothing to cap
    s = JobSettings.from_env()
    params = training_params("sisa", {"n_shards": 2}, RELU, s)
    assert params == {"n_shards": 2, "network": RELU, "device": "cpu"}
    assert training_params("dare", {}, None, s) == {}  # no torch network to place
    assert training_params("mlp", {"device": "cuda"}, None, s) == {"device": "cuda"}
    X, y, ids = _moons()
    model = ServedModel.train("sisa", np.array(ids, dtype=object), X, y, params, False)
    assert model.device == "cpu" and model.learner.get_params()["device"] == "cpu"
    assert model.learner.shard_training_args(0)["device"] == torch.device("cpu")
    for name, value, message in [
            ("DEVICE", "gpu", r"OBLIVIATE_DEVICE must be auto, cpu, cuda or cuda:N; got 'gpu'"),
            ("DEVICE", "cuda:x", r"must be auto, cpu, cuda or cuda:N; got 'cuda:x'"),
            ("CUDA_MEMORY_FRACTION", "0", r"OBLIVIATE_CUDA_MEMORY_FRACTION must be in \(0, 1\]"),
            ("CUDA_MEMORY_FRACTION", "1.5", r"must be in \(0, 1\]; got 1.5")]:
        with monkeypatch.context() as m:
            m.setenv(f"OBLIVIATE_{name}", value)
            with pytest.raises(ValueError, match=message):
                JobSettings.from_env().training_device()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="OBLIVIATE_DEVICE=cuda:1, but torch sees no CUDA"):
            JobSettings(device="cuda:1").training_device()


def _category_table(path: Path, n: int = 150) -> Path:
    """A CSV with text categories whose label follows one category and one number."""
    rng = np.random.default_rng(5)
    city = rng.choice(["Lyon", "Oslo", "Pune", "Quito"], n)
    plan = rng.choice(["basic", "plus", "pro"], n)
    age = rng.integers(18, 80, n)
    churn = np.where((city == "Oslo") | ((plan == "basic") & (age > 50)), "yes", "no")
    rows = ["id,city,age,plan,churn", *(
        f"r{i:03d},{c},{a},{p},{y}"
        for i, (c, a, p, y) in enumerate(zip(city, age, plan, churn, strict=True)))]
    path.write_text("\n".join(rows) + "\n")
    return path


def test_the_shipped_table_example_embeds_each_category_block(tmp_path: Path) -> None:
    """The installed example reads the ledger's one-hot blocks, found from the encoded
    feature names, through bias-free Linear layers (its embeddings), learns and forgets
    exactly; a block outside the row is refused at train time."""
    from jobs.learners.networks.examples.tables import category_blocks
    from ledger import datasets

    ds = datasets.load_csv(_category_table(tmp_path / "churn.csv"), "churn",
                           id_column="id", options=datasets.TableOptions(min_frequency=1))
    blocks = category_blocks(ds.feature_names)
    assert [ds.feature_names[s].split("=")[0] for s, _ in blocks] == ["city", "plan"]
    assert [w for _, w in blocks] == [5, 4]  # four cities and three plans, each + "other"
    params = {"n_shards": 2, "network": TABLES, "epochs_per_slice": 30, "lr": 0.05,
              "network_params": {"blocks": blocks, "dim": 3}, "random_state": 4}
    model = SISAEnsemble(**params).fit(ds.X, ds.y, record_ids=ds.record_ids)
    net = model.shard_networks_[0]
    assert [(e.in_features, e.out_features, e.bias) for e in net.embed] == [
        (5, 3, None), (4, 3, None)]
    assert model.bound_obstacle_.endswith("is a CategoryEmbeddingMLP, not a torch.nn."
                                          "Sequential of Linear and ReLU layers")
    assert (model.predict(ds.X) == ds.y).mean() > 0.8
    model.delete(ds.record_ids[:5])
    assert model.verify().exact
    with pytest.raises(NetworkError, match=r"block \[10, 4\] is outside the 10 features"):
        SISAEnsemble(**{**params, "network_params": {"blocks": [[10, 4]]}}).fit(ds.X, ds.y)


def test_the_demo_takes_a_network(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    """`obliviate demo --network` goes the way of `model train --network`: SISA only, and
    the device settings checked, before the demo makes anything (a whole demo with the
    shipped CNN takes minutes: docs/learners.md shows its command)."""
    from service.cli import main

    work = tmp_path / "demo"
    assert main(["demo", "--learner", "dare", "--network", CNN, "--workdir", str(work)]) == 2
    assert "--network (OBLIVIATE_NETWORK) needs --learner sisa or game, not 'dare'" in (
        capsys.readouterr().err)
    monkeypatch.setenv("OBLIVIATE_DEVICE", "gpu")
    assert main(["demo", "--learner", "sisa", "--network", CNN, "--dataset", "digits",
                 "--workdir", str(work)]) == 2
    assert "OBLIVIATE_DEVICE must be auto, cpu, cuda or cuda:N" in capsys.readouterr().err
    assert not work.exists()


GAME_SMALL = {"epochs": 8, "rounds": 5, "attack_steps": 50, "third_fraction": 0.25,
              "device": "cpu", "random_state": 5}


def test_the_game_learner_trains_a_user_network_and_retrains_it_exactly(
        tmp_path: Path) -> None:
    """`--learner game --network ...`: M_o, the surrogate and the shadow are the user's
    network (dropout seeded, so a retrain is the same bits); its deletion is approximate,
    its exact retrain verifies by content hash, and the version pins and carries the
    source as SISA's do."""
    X, y = _table(124)
    X, y, X_new, y_new = X[:120], y[:120], X[120:], y[120:]
    ids = np.array(_ids(120), dtype=object)
    model = ServedModel.train("game", ids, X, y, {"network": MLP, **GAME_SMALL,
                                                  "network_params": {"hidden": 16}})
    learner = model.learner
    source = hashlib.sha256(EXAMPLES.read_bytes()).hexdigest()
    assert learner.network_ == {"path": MLP, "sha256": source, "params": {"hidden": 16}}
    assert learner.config_["model"] == "network" and learner.verify().exact
    assert isinstance(learner.net_[2], torch.nn.Dropout)  # the user's module is served
    train = learner.record_ids_[learner.train_mask_]
    learner.delete(train[:3])
    learner.add(np.array(_ids(4, "n"), dtype=object), X_new, y_new)  # fine-tuned, approximate
    assert model.forgetting == "approximate" and not learner.verify().exact
    exact = model.exact_replacement()
    assert exact.forgetting == "exact" and exact.learner.verify().exact
    assert set(_ids(4, "n")) <= set(exact.learner.record_ids_[exact.learner.train_mask_])
    man = manifest(exact, seq=2, parent=None, ledger_seq=0, training_set=(121, "root"),
                   change={"op": "exact_retrain"})
    assert man["network"]["sha256"] == source and man["forgetting"] == "exact"
    exact.save(tmp_path / "v2")
    assert (tmp_path / "v2" / "learner" / SOURCE_FILE).exists()
    served = load_as_published(tmp_path / "v2", man)
    assert served.learner.content_hash() == exact.learner.content_hash()
    assert (served.plain_labels(X[:20]) == exact.plain_labels(X[:20])).all()
    # the network is part of the hash: the same run with other params is another model
    other = ServedModel.train("game", ids, X, y, {"network": MLP, **GAME_SMALL,
                                                  "network_params": {"hidden": 17}})
    assert other.learner.content_hash() != ServedModel.train(
        "game", ids, X, y, {"network": MLP, **GAME_SMALL,
                            "network_params": {"hidden": 16}}).learner.content_hash()
    assert with_network("game", {}, MLP) == {"network": MLP}


@pytest.mark.slow  # 40 retrains of five CNN shards: 13-25 s on two shared cores
def test_the_vote_rule_is_sound_for_a_cnn_against_brute_force_retrains() -> None:
    """Every answer the served rule calls certain is the answer of the model retrained
    from scratch without any one record (no bound: every shard counts as fragile)."""
    X, y = _digits((0, 1, 2))
    n = 40
    ids = _ids(n)
    params = {"n_shards": 5, "network": CNN, "epochs_per_slice": 30, "lr": 0.02,
              "random_state": 11}
    queries = np.concatenate([X[:n], X[200:260]])
    served = ShardVoteModel(SISAEnsemble(**params).fit(X[:n], y[:n], record_ids=ids))
    winner, certain = served.certain(queries)
    assert (served.learner.classes_[winner] == served.learner.predict(queries)).all()
    assert certain.sum() >= 20  # the check is not vacuous
    for i in range(n):
        keep = np.arange(n) != i
        loo = SISAEnsemble(**params).fit(X[:n][keep], y[:n][keep],
                                         record_ids=np.array(ids)[keep])
        moved = loo.predict(queries) != served.learner.classes_[winner]
        assert not (moved & certain).any(), f"a certain answer moved without {ids[i]}"


@pytest.mark.processes
def test_obliviate_trains_serves_and_forgets_with_a_user_network(tmp_path: Path) -> None:
    """`obliviate model train` (OBLIVIATE_NETWORK, imported from the current directory),
    `obliviate serve` answering and the worker verifying a deletion exact by retrain: both
    run the version's copy of the module (`tests` is not importable in their processes)."""
    from ledger import datasets
    from tests.sidecar import Sidecar

    with Sidecar(tmp_path, learner="sisa", dataset="digits", env={"OBLIVIATE_NETWORK": CNN},
                 train_params='{"n_shards": 3, "epochs_per_slice": 5}') as sc:
        first = sc.models()["current"]["manifest"]
        source = hashlib.sha256(CNN_SOURCE.read_bytes()).hexdigest()
        assert first["network"] == {"path": CNN, "sha256": source, "params": {}}
        assert first["guard"]["rule"] == "sisa-vote" and first["guard"]["shard_bound"] == "inf"
        digits = datasets.load("digits")
        X = digits.X[:20]  # the model's input space
        answer = sc.predict(X)
        assert len(answer["labels"]) == 20 and answer["guard"] == "sound"
        sc.start_worker()
        assert sc.submit({"request_id": "d1", "op": "delete",
                          "record_ids": [digits.record_ids[1]]}).status_code == 202
        # the worker's start and the CNN's retrains (the delete, the exactness check) took
        # over a minute on the shared 2-core machine at load average 20
        sc.wait_for_status(["d1"], "verified", timeout_s=300.0)
        now = sc.models()["current"]["manifest"]
        assert now["change"]["op"] != "train" and now["network"] == first["network"]
        assert sc.predict(X)["model_version"] == sc.models()["current"]["version"]


@pytest.mark.processes
def test_obliviate_serves_the_game_on_a_user_network_approximate_then_exact(
        tmp_path: Path) -> None:
    """`--learner game` with OBLIVIATE_NETWORK, over HTTP: answers say `exact` for the
    trained version; a deletion is applied, then replaced by the exact retrain (its hash
    reproduced) and only then `verified`; /v1/predict and /metrics say what was served."""
    from ledger import datasets
    from tests.sidecar import Sidecar

    params = json.dumps({"network_params": {"hidden": 16}, **GAME_SMALL})
    with Sidecar(tmp_path, learner="game", env={"OBLIVIATE_NETWORK": MLP},
                 train_params=params) as sc:
        first = sc.models()["current"]["manifest"]
        assert first["network"]["path"] == MLP and first["forgetting"] == "exact"
        data = datasets.load("breast_cancer")
        X = data.X[:10]
        answer = sc.predict(X)
        assert answer["guard"] == "unguarded" and answer["promises"] == ["exact"] * 10
        sc.start_worker()
        # eight records: the game trains on 75% of them (one held out changes nothing)
        assert sc.submit({"request_id": "g1", "op": "delete",
                          "record_ids": list(data.record_ids[2:10])}).status_code == 202
        history = sc.wait_for_status(["g1"], "verified", timeout_s=180)["g1"]
        applied, verified = (next(e for e in history["events"] if e["kind"] == k)
                             for k in ("applied", "verified"))
        now = sc.models()["current"]
        change = now["manifest"]["change"]
        assert change["op"] == "exact_retrain" and change["replaces"] == [
            applied["model_version"]]
        assert verified["model_version"] == now["version"] != applied["model_version"]
        assert change["exactness"]["exact"] is True and now["manifest"]["forgetting"] == "exact"
        assert now["manifest"]["network"] == first["network"]
        end = time.monotonic() + 30  # the service polls the registry
        while (answer := sc.predict(X))["model_version"] != now["version"]:
            assert time.monotonic() < end, answer
            time.sleep(0.2)
        assert answer["promises"] == ["exact"] * 10
        metrics = httpx.get(sc.url + "/metrics", timeout=30).text
        assert re.search(r'obliviate_answers_total\{promise="exact"\} [1-9]', metrics)
