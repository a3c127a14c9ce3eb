"""SISA and the game learner on a network of the user's (issue 30), given by import path:
SISA trains, deletes and adds exactly (a retrain from scratch gives the same hash), the
game's exact retrain verifies by hash; the source is pinned and saved with the model,
mistakes are refused at train time with one line, and the vote rule that serves SISA is
sound against brute-force leave-one-out retrains of a CNN.
See docs/learners.md (Your own network)."""

from __future__ import annotations

import hashlib
import json
import re
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits, make_classification

from jobs.learners.networks.user_network import SOURCE_FILE, NetworkError
from jobs.learners.sisa.ensemble import SISAEnsemble
from jobs.orchestration.model_commands import with_network
from jobs.orchestration.registry import manifest
from jobs.orchestration.served_model import (
    NotAsPublished,
    ServedModel,
    ShardVoteModel,
    load_as_published,
)

CNN = "tests.user_networks:digits_cnn"
MLP = "tests.user_networks:dropout_mlp"
EXAMPLES = Path(__file__).with_name("user_networks.py")


def _digits(classes: tuple[int, ...] = tuple(range(10))) -> tuple[np.ndarray, np.ndarray]:
    X, y = load_digits(return_X_y=True)
    keep = np.isin(y, classes)
    return (X[keep] / 16.0).astype(np.float32), y[keep]


def _ids(n: int, prefix: str = "r") -> list[str]:
    return [f"{prefix}{i:04d}" for i in range(n)]


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
        EXAMPLES.read_bytes()).hexdigest(), "params": {"channels": 4}}
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
    ("tests.user_networks:digits_cnn", r"build\(6, 3, \*\*\{\}\) raised ValueError: "
                                       r"6 features are not a square image"),
])
def test_a_network_that_cannot_serve_is_refused_at_train_time(network: str,
                                                              message: str) -> None:
    X, y = _table(30)
    with pytest.raises(NetworkError, match=message) as err:
        SISAEnsemble(network=network).fit(X, y)
    assert "\n" not in str(err.value) and repr(network) in str(err.value)


def test_settings_a_user_network_cannot_take() -> None:
    X, y = _table(30)
    with pytest.raises(ValueError, match="a network of your own trains with schedule='adam'"):
        SISAEnsemble(network=MLP, schedule="loo").fit(X, y)
    with pytest.raises(ValueError, match="optimizer='sgd' needs a network of your own"):
        SISAEnsemble(optimizer="sgd").fit(X, y)
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
    assert man["guard"]["rule"] == "sisa-vote" and man["guard"]["shard_bound"] == "inf"
    assert "no per-shard bounds" in man["guard"]["why"]
    model.save(tmp_path / "v1")
    served = load_as_published(tmp_path / "v1", man)
    assert (served.certain(X[90:120])[0] == model.certain(X[90:120])[0]).all()
    edited = json.loads(json.dumps(man))
    edited["network"]["sha256"] = "0" * 64
    with pytest.raises(NotAsPublished, match="its network's source is"):
        load_as_published(tmp_path / "v1", edited)


GAME_SMALL = {"epochs": 8, "rounds": 5, "attack_steps": 50, "third_fraction": 0.25,
              "device": "cpu", "random_state": 5}


def test_the_game_learner_trains_a_user_network_and_retrains_it_exactly(
        tmp_path: Path) -> None:
    """`--learner game --network ...`: M_o, the surrogate and the shadow are the user's
    network (dropout seeded, so a retrain is the same bits); its deletion is approximate,
    its exact retrain verifies by content hash, and the version pins and carries the
    source as SISA's do."""
    X, y = _table(120)
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
    assert model.forgetting == "approximate" and not learner.verify().exact
    exact = model.exact_replacement()
    assert exact.forgetting == "exact" and exact.learner.verify().exact
    man = manifest(exact, seq=2, parent=None, ledger_seq=0, training_set=(117, "root"),
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
        source = hashlib.sha256(EXAMPLES.read_bytes()).hexdigest()
        assert first["network"] == {"path": CNN, "sha256": source, "params": {}}
        assert first["guard"]["rule"] == "sisa-vote" and first["guard"]["shard_bound"] == "inf"
        digits = datasets.load("digits")
        X = digits.X[:20]  # the model's input space
        answer = sc.predict(X)
        assert len(answer["labels"]) == 20 and answer["guard"] == "sound"
        sc.start_worker()
        assert sc.submit({"request_id": "d1", "op": "delete",
                          "record_ids": [digits.record_ids[1]]}).status_code == 202
        sc.wait_for_status(["d1"], "verified")
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
