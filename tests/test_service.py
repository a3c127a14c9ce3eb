"""The BentoML service over real HTTP: validation, auth, hot swap under load, metrics.

One sidecar for the module: `obliviate serve` with two serving processes (BentoML's
multi-process mode), one `obliviate worker` with its metrics port open, a DaRE forest
small enough to update and guard in a second, breast_cancer in the ledger.

- Inputs: wrong row length, strings, NaN (raw JSON text), values outside [0, 1], an
  empty list and a batch over the limit each get a 4xx that names the problem; answers
  hold a label per row and nothing else. Admin endpoints refuse a missing (401) and a
  wrong (403) token; intake says why a body is malformed and what a duplicate is.
- Hot swap: client threads hammer /v1/predict while the worker publishes version after
  version; no answer fails, every connection sees versions only move forward, and
  afterwards every serving process answers with the newest version.
- Metrics: the guard's counts in /metrics are the sum over both processes, exactly the
  rows answered; the ledger's gauges come from the database; every metric the alert
  rules and the dashboard query is exported by the live service or worker.
"""

from __future__ import annotations

import json
import math
import threading
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.parser import text_string_to_metric_families

from ledger.datasets import load
from service.demo.processes import free_port
from service.service import MAX_BATCH
from tests.sidecar import Sidecar
from tests.test_deploy import _alert_exprs, _dashboard_exprs, metric_names

# `obliviate serve` (two serving processes) and `obliviate worker`
pytestmark = pytest.mark.processes

N_FEATURES = 30
WRONG_TOKEN = "not-the-admin-token-at-all-0000000"
# breast_cancer rows, scaled to [0, 1] like every query must be
X = load("breast_cancer").X
ROWS_ANSWERED = [0]  # rows of every 200 answer of /v1/predict in this module
_ROWS_LOCK = threading.Lock()
# deleted by the tests, in this order (record ids of breast_cancer)
DELETIONS = iter(f"r{i:03d}" for i in range(100, 200))


class Service:
    """The module's sidecar and the worker's metrics address."""

    def __init__(self, sidecar: Sidecar, worker_metrics: str) -> None:
        self.sc = sidecar
        self.worker_metrics = worker_metrics


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    port = free_port()
    sc = Sidecar(tmp_path_factory.mktemp("service"), learner="dare", service_workers=2,
                 train_params=json.dumps({"n_estimators": 10, "max_depth": 5}))
    try:
        sc.start(workers=1, worker_args=["--metrics-port", str(port)])
        yield Service(sc, f"http://127.0.0.1:{port}/metrics")
    finally:
        sc.close()


def predict(client: httpx.Client, instances: Any, scaled: bool = True) -> httpx.Response:
    """POST /v1/predict (rows in the model's input space unless `scaled` is False); rows
    of a 200 answer are tallied in ROWS_ANSWERED."""
    r = client.post("/v1/predict", json={"instances": instances, "scaled": scaled})
    if r.status_code == 200:
        with _ROWS_LOCK:
            ROWS_ANSWERED[0] += len(r.json()["labels"])
    return r


def error_text(r: httpx.Response) -> str:
    """The error message of a 4xx answer, with pydantic's details when there are any.

    BentoML answers an API's InvalidArgument with ``[{"error": ...}]`` (a one-element
    list; _bentoml_impl/server/app.py builds a tuple) and its own input validation with
    ``{"error": ..., "detail": [...]}``; the admin endpoints with ``{"error": ...}``.
    """
    body = r.json()
    if isinstance(body, list):
        [body] = body
    details = [f"{'.'.join(map(str, d['loc']))}: {d['msg']}" for d in body.get("detail", [])]
    return "; ".join([body["error"], *details])


def delete_next(sc: Sidecar, request_id: str) -> None:
    r = sc.submit({"request_id": request_id, "op": "delete", "record_ids": [next(DELETIONS)]})
    assert r.status_code == 202, r.text


def scrape(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Sample name -> [(labels, value)] of a Prometheus text page."""
    r = httpx.get(url, timeout=30)
    assert r.status_code == 200, r.text[:500]
    out: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[s.name].append((s.labels, s.value))
    return out


def value(samples: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    """The one value of an unlabelled sample."""
    [(labels, v)] = samples[name]
    return v


def seq(version: str) -> int:
    return int(version.lstrip("v"))


def wait_idle(sc: Sidecar, timeout_s: float = 90.0) -> dict[str, Any]:
    """Until the worker has nothing left to do: no request pending or awaiting its
    exactness check, and the current version guarded; that version."""
    def idle() -> dict[str, Any] | None:
        cur = sc.models()["current"]
        m = scrape(sc.url + "/metrics")
        done = (value(m, "obliviate_requests_pending") == 0
                and value(m, "obliviate_requests_unverified") == 0)
        return cur if done and cur["manifest"]["guard"]["ready"] else None
    return sc.wait_until(idle, timeout_s, "the worker to be idle")


# --------------------------------------------------------------------------- (a) inputs

def row(v: Any = 0.5) -> list[Any]:
    return [v] * N_FEATURES


@pytest.mark.parametrize(("instances", "expected"), [
    ([row()[:29]], "row 0 has 29 features; the model takes 30"),
    ([row(), [*row()[:-1], 0.5, 0.5]], "row 1 has 31 features"),
    ([[*row()[:3], "0.5", *row()[4:]]], "row 0, feature 3: '0.5' is not a number"),
    ([[*row()[:5], True, *row()[6:]]], "row 0, feature 5: True is not a number"),
    ([[*row()[:2], 1.5, *row()[3:]]], "row 0, feature 2: 1.5 is outside [0, 1]"),
    ([row(-0.25)], "row 0, feature 0: -0.25 is outside [0, 1]"),
    ([], "'instances' must be a non-empty list"),
    ([row(), 0.5], "row 1 is not a list of numbers"),
    ([row()] * (MAX_BATCH + 1), f"at most {MAX_BATCH} rows per call, got {MAX_BATCH + 1}"),
], ids=["short-row", "long-row", "string", "boolean", "above-1", "below-0", "empty", "mixed",
        "batch-over-limit"])
def test_invalid_instances_get_a_4xx_naming_the_problem(svc: Service, instances: Any,
                                                        expected: str) -> None:
    r = predict(svc.sc.http, instances)
    assert r.status_code == 400, (r.status_code, r.text[:300])
    assert expected in error_text(r)


@pytest.mark.parametrize(("body", "expected"), [
    ('{"instances": [[NaN' + ", 0.5" * 29 + "]]}", "row 0, feature 0: nan is not finite"),
    ('{"instances": [[0.5, Infinity' + ", 0.5" * 28 + "]]}",
     "row 0, feature 1: inf is not finite"),
    ('{"instances": "0.5, 0.5"}', "instances: Input should be a valid array"),
    ('{"rows": [[0.5]]}', "instances: Field required"),
    ('{"instances": [[0.5, 0.5]', "Invalid JSON"),
], ids=["nan", "infinity", "not-a-list", "no-instances", "truncated-json"])
def test_raw_json_that_is_not_a_finite_batch_gets_a_4xx(svc: Service, body: str,
                                                         expected: str) -> None:
    r = svc.sc.http.post("/v1/predict", content=body,
                         headers={"Content-Type": "application/json"})
    assert r.status_code == 400, (r.status_code, r.text[:300])
    assert expected in error_text(r)


def test_a_row_and_a_batch_get_labels_only(svc: Service) -> None:
    one = predict(svc.sc.http, X[0].tolist())
    assert one.status_code == 200, one.text
    batch = predict(svc.sc.http, X[:25].tolist())
    assert batch.status_code == 200, batch.text
    for r, n in ((one, 1), (batch, 25)):
        body = r.json()
        # labels only: no scores, probabilities, margins or votes
        assert set(body) == {"labels", "model_version", "guard", "promises"}
        assert len(body["labels"]) == n and set(body["labels"]) <= {0, 1}
        assert body["guard"] in ("sound", "noise-all")
        # per answer what it promises: a forest's are certified by its guard or noised
        assert len(body["promises"]) == n
        assert set(body["promises"]) <= ({"certified", "noised"} if body["guard"] == "sound"
                                         else {"noised"})
        assert seq(body["model_version"]) >= 1
    edge = predict(svc.sc.http, [[0.0] * N_FEATURES, [1.0] * N_FEATURES])
    assert edge.status_code == 200, edge.text  # the bounds of the range are valid


def test_raw_features_are_scaled_by_the_stored_transform(svc: Service) -> None:
    """A row in the features' own units gets the answer its scaled row gets (the same
    bits reach the guard); values beyond the initial table's range count as its edge."""
    ds = load("breast_cancer")
    raw = ds.raw[::40]
    far = np.vstack([raw[:2] * 10, raw[:2] - 1e6])  # outside every range: clipped
    for _ in range(5):  # the worker may publish between the two calls: retry then
        a = predict(svc.sc.http, raw.tolist(), scaled=False)
        b = predict(svc.sc.http, ds.X[::40].tolist())
        c = predict(svc.sc.http, far.tolist(), scaled=False)
        d = predict(svc.sc.http, np.clip(ds.transform.scale(far), 0, 1).tolist())
        assert all(r.status_code == 200 for r in (a, b, c, d)), (a.text, c.text)
        if len({r.json()["model_version"] for r in (a, b, c, d)}) == 1:
            break
    assert a.json()["labels"] == b.json()["labels"]
    assert c.json()["labels"] == d.json()["labels"]
    # pre-scaled rows must be in [0, 1]; raw ones only finite
    assert predict(svc.sc.http, raw[:1].tolist()).status_code == 400
    r = predict(svc.sc.http, [[float("1e308")] * N_FEATURES], scaled=False)
    assert r.status_code == 200, r.text


def test_the_schema_names_the_features_their_ranges_and_the_classes(svc: Service) -> None:
    ds = load("breast_cancer")
    r = svc.sc.get("/v1/schema", admin=False)  # public: clients need it to send rows
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["n_features"] == N_FEATURES and doc["classes"] == [0, 1]
    assert doc["transform"] == "min-max" and "raw" in doc["input"]
    assert [f["name"] for f in doc["features"]] == list(ds.feature_names)
    assert doc["features"][0]["name"] == "mean radius"
    for f, lo, hi, col in zip(doc["features"], ds.transform.mins, ds.transform.maxs,
                              ds.raw.T, strict=True):
        assert (f["min"], f["max"]) == (lo, hi)
        assert f["min"] < col.min() and col.max() < f["max"]  # widened: no record's value


def test_no_id_reaches_a_metric_label_or_a_log_line(svc: Service) -> None:
    """Request, subject and record ids are personal data: after a deletion submitted over
    HTTP and look-ups by request and by subject, neither the service's nor the worker's
    /metrics, nor any log line, holds one (BentoML's request metrics and access log show
    route templates)."""
    sc = svc.sc
    subject, records = "s150", ["r450", "r451", "r452"]
    request_id, unknown = "http-del-qz81x", "lookup-qz81y"
    r = sc.submit({"request_id": request_id, "op": "delete", "subject_id": subject})
    assert r.status_code == 202, r.text
    assert sc.get(f"/v1/requests/{request_id}").status_code == 200
    assert sc.get(f"/v1/requests/{unknown}").status_code == 404
    assert sc.get(f"/v1/subjects/{subject}/requests").status_code == 200
    assert sc.get(f"/v1/subjects/{unknown}/requests").status_code == 200
    assert sc.get(f"/v1/forgotten/{request_id}").status_code in (200, 422)
    assert sc.get(f"/v1/requests/{request_id}", admin=False).status_code == 401
    sc.wait_for_status([request_id], "applied", timeout_s=90)
    ids = [request_id, unknown, subject, *records]
    service_metrics = httpx.get(sc.url + "/metrics", timeout=30).text
    worker_metrics = httpx.get(svc.worker_metrics, timeout=30).text
    for name, text in (("service /metrics", service_metrics),
                       ("worker /metrics", worker_metrics)):
        leaked = [i for i in ids if i in text]
        assert not leaked, f"{name} holds {leaked}"
    # the route, not the path, names BentoML's series
    assert 'endpoint="/v1/requests/{request_id}"' in service_metrics
    assert 'endpoint="/v1/subjects/{subject_id}/requests"' in service_metrics
    for proc in sc.procs:
        text = proc.log_path.read_text(errors="replace")
        leaked = [(i, line) for line in text.splitlines() for i in ids if i in line]
        assert not leaked, f"{proc.name}'s log {proc.log_path}: {leaked[:3]}"


@pytest.mark.parametrize(("method", "path"), [
    ("POST", "/v1/requests"), ("GET", "/v1/requests/anything"),
    ("GET", "/v1/subjects/s001/requests"), ("GET", "/v1/guard/usage"),
])
def test_admin_endpoints_need_the_token(svc: Service, method: str, path: str) -> None:
    body = {"request_id": "never", "op": "delete", "record_ids": ["r001"]}
    kwargs: dict[str, Any] = {"json": body} if method == "POST" else {}
    http = svc.sc.http
    missing = http.request(method, path, **kwargs)
    assert missing.status_code == 401, missing.text
    assert "Bearer" in error_text(missing) and missing.headers["WWW-Authenticate"]
    basic = http.request(method, path, headers={"Authorization": "Basic dXNlcjpwdw=="},
                         **kwargs)
    assert basic.status_code == 401, basic.text
    wrong = http.request(method, path, headers=svc.sc.headers(WRONG_TOKEN), **kwargs)
    assert wrong.status_code == 403, wrong.text
    assert "not valid" in error_text(wrong)
    # nothing was recorded by the refused intake
    assert svc.sc.history("never") is None


@pytest.mark.parametrize(("body", "status", "reason"), [
    ("", 400, "empty body"),
    ("{not json", 422, "malformed JSON"),
    ('["a", "list"]', 422, "must be a JSON object"),
    ('{"op": "delete", "record_ids": ["r001"]}', 422, "missing field 'request_id'"),
    ('{"request_id": "m-1", "op": "forget", "record_ids": ["r001"]}', 422, "unknown op"),
    ('{"request_id": "m-2", "op": "delete"}', 422, "needs 'subject_id' or 'record_ids'"),
    ('{"request_id": "m-3", "op": "delete", "record_ids": ["nobody"]}', 422,
     "unknown record"),
    ('{"request_id": "m-4", "op": "add", "subject_id": "s1", "payload": {"records": '
     '[{"record_id": "n1", "features": [0.5], "label": 0}]}}', 422,
     "features must be a list of 30 numbers"),
], ids=["empty", "not-json", "not-object", "no-id", "bad-op", "no-target", "unknown-record",
        "short-features"])
def test_malformed_requests_are_refused_with_the_reason(svc: Service, body: str, status: int,
                                                       reason: str) -> None:
    r = svc.sc.submit(body)
    assert r.status_code == status, r.text
    answer = r.json()
    if status == 422:
        assert answer["status"] == "rejected"
        assert reason in answer["reason"], answer
    else:
        assert reason in answer["error"], answer


def test_a_duplicate_request_id_is_reported_as_duplicate(svc: Service) -> None:
    sc = svc.sc
    request = {"request_id": "dup-1", "op": "delete", "record_ids": [next(DELETIONS)]}
    first = sc.submit(request)
    assert first.status_code == 202 and first.json()["status"] == "accepted", first.text
    again = sc.submit(request)
    assert again.status_code == 200, again.text
    assert again.json()["status"] == "duplicate"
    assert again.json()["request_id"] == "dup-1"
    # a different request under the same id is a duplicate too, not a second request
    other = sc.submit({**request, "record_ids": [next(DELETIONS)]})
    assert other.json()["status"] == "duplicate", other.text
    history = sc.history("dup-1")
    assert history["request"]["duplicate_count"] == 2
    assert [e["kind"] for e in history["events"]].count("received") == 1


def test_public_endpoints_give_no_seed_host_or_process_away(svc: Service) -> None:
    """The seeds decide which shard holds whom (private prediction mode rests on them);
    host names and process ids help an attacker: none is in an unauthenticated answer."""
    sc = svc.sc
    with httpx.Client(base_url=sc.url, timeout=10) as client:
        public = [client.get(p) for p in ("/v1/models", "/v1/models/lineage")]
        full = client.get("/v1/models", headers=sc.headers()).json()
    seed = full["current"]["manifest"]["seed"]
    host, pid = full["serving"]["process"].rsplit(":", 1)
    assert seed and seed != 0 and full["current"]["manifest"]["params"]["random_state"] == seed
    for r in public:
        assert r.status_code == 200
        text = r.text
        for secret in ('"seed"', '"random_state"', '"built_by"', '"process"', host,
                       f":{pid}"):
            assert secret not in text, (r.url, secret)
    # the files holding the ledger, the keys and the token are private
    for name in ("ledger.db", "hmac.key", "admin.token"):
        path = sc.workdir / name
        if path.exists():
            assert path.stat().st_mode & 0o077 == 0, name


def test_near_duplicates_get_one_noised_answer_in_every_process(svc: Service) -> None:
    """A query and 300 ulp-perturbed copies of it, asked over fresh connections (both
    serving processes): one answer for all of them, and at most one fresh epsilon per
    process, however often they are asked."""
    sc = svc.sc

    def noised_and_spent() -> tuple[float, float]:
        m = scrape(sc.url + "/metrics")
        noised = sum(v for lab, v in m["obliviate_guard_queries_total"]
                     if lab.get("outcome") == "noised")
        return noised, value(m, "obliviate_guard_epsilon_spent_total")

    def uncertified_query(rng: np.random.Generator) -> tuple[np.ndarray, str]:
        """A query some version noises, and that version."""
        for _ in range(50):
            q = rng.random(N_FEATURES).astype(np.float32)
            with httpx.Client(base_url=sc.url, timeout=30) as client:
                r = predict(client, [q.tolist()])
            assert r.status_code == 200, r.text
            if r.json()["promises"] == ["noised"]:
                return q, r.json()["model_version"]
        pytest.skip("every query tried was certified")

    rng = np.random.default_rng(8)
    # the worker may publish a version mid-measurement (earlier tests' deletions, a guard
    # refit) that certifies the query: the count below holds for one version, so measure
    # again, with a query this version noises, until the version that noised the query
    # answered every round
    for _ in range(5):
        first, noised_by = uncertified_query(rng)
        copies = [first]
        for _ in range(300):
            copies.append(np.nextafter(copies[-1], np.float32(1.0)))
        rows = [c.tolist() for c in copies]
        start = noised_and_spent()
        labels: dict[str, set[int]] = defaultdict(set)  # per version
        for _ in range(6):
            with httpx.Client(base_url=sc.url, timeout=30) as client:
                r = predict(client, rows)
                assert r.status_code == 200, r.text
                labels[r.json()["model_version"]] |= set(r.json()["labels"])
        noised, spent = noised_and_spent()
        assert all(len(v) == 1 for v in labels.values()), labels
        if set(labels) == {noised_by}:
            break
    assert set(labels) == {noised_by}, f"a new version every time: {sorted(labels)}"
    epsilon = float(sc.env.get("OBLIVIATE_EPSILON", "1.0"))
    assert noised - start[0] == 6 * len(rows), (noised, start, sorted(labels))
    # one fresh draw per process at most
    assert spent - start[1] <= 2 * epsilon + 1e-9


# --------------------------------------------------------------------------- (b) hot swap

class Hammer(threading.Thread):
    """Predicts in a loop until stopped; a fresh connection every `per_connection` calls
    so that both serving processes get traffic."""

    def __init__(self, base_url: str, stop: threading.Event, seed: int,
                 per_connection: int = 15) -> None:
        super().__init__(daemon=True)
        self.base_url, self.stop, self.per_connection = base_url, stop, per_connection
        self.rng = np.random.default_rng(seed)
        self.failures: list[str] = []
        self.connections: list[list[str]] = []  # the versions each connection saw, in order

    def run(self) -> None:
        while not self.stop.is_set():
            seen: list[str] = []
            self.connections.append(seen)
            with httpx.Client(base_url=self.base_url, timeout=30) as client:
                for _ in range(self.per_connection):
                    if self.stop.is_set():
                        break
                    rows = X[self.rng.integers(0, len(X), int(self.rng.integers(1, 9)))]
                    try:
                        r = predict(client, rows.tolist())
                    except httpx.HTTPError as exc:
                        self.failures.append(f"{exc.__class__.__name__}: {exc}")
                        continue
                    if r.status_code != 200:
                        self.failures.append(f"HTTP {r.status_code}: {r.text[:200]}")
                        continue
                    seen.append(r.json()["model_version"])


def test_hot_swap_under_load_fails_no_request(svc: Service) -> None:
    sc = svc.sc
    start = sc.models()["current"]["version"]
    stop = threading.Event()
    hammers = [Hammer(sc.url, stop, seed) for seed in range(4)]
    for h in hammers:
        h.start()

    def answered_by(version: str) -> bool:
        return any(c and seq(c[-1]) >= seq(version) for h in hammers for c in h.connections)

    try:
        # load first, then the swaps
        sc.wait_until(lambda: all(any(h.connections) for h in hammers), 30,
                      "every client to be answered")
        ids = []
        for i in range(3):  # each deletion publishes an update version (then a guard one)
            rid = f"swap-{i}"
            delete_next(sc, rid)
            ids.append(rid)
            sc.wait_for_status([rid], "applied", timeout_s=60)
            applied = sc.models()["current"]["version"]
            sc.wait_until(lambda v=applied: answered_by(v), 30,
                          f"a client to be answered by {applied}")
        newest = sc.models()["current"]["version"]
        assert seq(newest) >= seq(start) + 3
        # clients are answered by it before the load stops
        sc.wait_until(lambda: answered_by(newest), 30, f"a client to be answered by {newest}")
    finally:
        stop.set()
        for h in hammers:
            h.join(30)
    failures = [f for h in hammers for f in h.failures]
    answers = [v for h in hammers for c in h.connections for v in c]
    assert not failures, f"{len(failures)} of {len(failures) + len(answers)} failed: " \
                         f"{failures[:5]}\n{sc.logs(20)}"
    assert len(answers) > 50
    observed = sorted({seq(v) for v in answers})
    assert observed[0] <= seq(start) and observed[-1] >= seq(start) + 3, observed
    assert len(observed) >= 3, observed  # clients saw versions in between, not just two
    # one connection talks to one process: its versions only ever move forward
    for h in hammers:
        for c in h.connections:
            assert [seq(v) for v in c] == sorted(seq(v) for v in c), c

    # afterwards every serving process answers with the newest version (the worker may
    # publish its guard refit meanwhile: "newest" is the registry's current one)
    def all_swapped() -> bool:
        m = scrape(sc.url + "/metrics")
        return value(m, "obliviate_served_model_version") == value(
            m, "obliviate_model_version") >= seq(newest)
    sc.wait_until(all_swapped, 15, "every serving process to serve the current version")

    def every_process_on_current() -> dict[str, str] | None:
        current = sc.models()["current"]["version"]
        processes: dict[str, str] = {}
        for _ in range(20):  # fresh connections land on either process
            with httpx.Client(base_url=sc.url, timeout=10) as client:
                serving = client.get("/v1/models", headers={  # the admin sees processes
                    "Authorization": f"Bearer {sc.admin_token}"}).json()["serving"]
            processes[serving["process"]] = serving["version"]
        return processes if len(processes) == 2 and set(processes.values()) == {
            current} else None
    sc.wait_until(every_process_on_current, 20, "both processes to report the current version")


# --------------------------------------------------------------------------- (c) metrics

def guard_counts_by_process(sc: Sidecar) -> dict[str, float]:
    """obliviate_guard_queries per serving process, read from BentoML's multiprocess files."""
    counts: dict[str, float] = defaultdict(float)
    for path in sc.prometheus_dir.glob("counter_*.db"):
        for key, v, _ts, _pos in MmapedDict.read_all_values_from_file(str(path)):
            if json.loads(key)[0] == "obliviate_guard_queries":
                counts[path.stem.removeprefix("counter_")] += v
    return dict(counts)


def test_metrics_aggregate_both_serving_processes(svc: Service) -> None:
    sc = svc.sc
    # N rows from several connections, so that both processes answer some
    rng = np.random.default_rng(42)
    sizes = rng.integers(1, 7, 40)
    before = ROWS_ANSWERED[0]
    for n in sizes:
        with httpx.Client(base_url=sc.url, timeout=30) as client:
            r = predict(client, X[rng.integers(0, len(X), int(n))].tolist())
        assert r.status_code == 200, r.text
    assert ROWS_ANSWERED[0] - before == int(sizes.sum())
    m = scrape(sc.url + "/metrics")
    by_outcome = {labels["outcome"]: v for labels, v in m["obliviate_guard_queries_total"]}
    assert set(by_outcome) <= {"certain", "noised"} and by_outcome
    # every row this module got an answer for, counted once, whichever process answered
    assert sum(by_outcome.values()) == ROWS_ANSWERED[0]
    per_process = guard_counts_by_process(sc)
    assert len([v for v in per_process.values() if v]) == 2, per_process
    assert sum(per_process.values()) == ROWS_ANSWERED[0]

    assert value(m, "obliviate_guard_mode") in (0.0, 1.0)
    assert value(m, "obliviate_guard_complete") == 1.0  # its first version: a full fit
    assert value(m, "obliviate_guard_epsilon_per_query") == 1.0
    assert value(m, "obliviate_guard_epsilon_spent_total") >= 0.0
    assert not math.isnan(value(m, "obliviate_guard_epsilon_budget"))


def test_every_metric_the_alerts_and_dashboard_query_is_exported(svc: Service) -> None:
    wait_idle(svc.sc)  # the worker has refitted a guard since its last update
    worker = scrape(svc.worker_metrics)
    service = scrape(svc.sc.url + "/metrics")
    queried = {name for _, expr in _alert_exprs() + _dashboard_exprs()
               for name in metric_names(expr)}
    # (obliviate_dead_letters_total is the consumer's, but every process that imports the
    # ledger exports it, at 0 where nothing is dead-lettered)
    missing = sorted(queried - set(service) - set(worker))
    assert not missing, f"queried but not exported by the live service or worker: {missing}"
    # the worker's metrics are the worker's: update and deletion timings
    for name in ("obliviate_deletion_latency_seconds_bucket",
                 "obliviate_model_update_seconds_bucket", "obliviate_guard_bound_seconds_bucket",
                 "obliviate_requests_applied_total", "obliviate_verify_failures_total"):
        assert name in worker, name
    assert value(worker, "obliviate_verify_failures_total") == 0
    assert value(worker, "obliviate_update_failures_total") == 0


def test_ledger_gauges_come_from_the_database(svc: Service) -> None:
    """Last: it stops the worker."""
    sc = svc.sc
    cur = wait_idle(sc)
    m = scrape(sc.url + "/metrics")
    assert value(m, "obliviate_model_version") == cur["seq"]
    assert value(m, "obliviate_requests_pending") == 0
    # with the worker stopped, a new request stays pending: both processes count it
    # (the gauge is read from the ledger at scrape time, not kept per process)
    assert sc.stop_worker() == 0
    delete_next(sc, "pending-1")
    for _ in range(6):
        with httpx.Client(base_url=sc.url, timeout=10) as client:
            page = client.get("/metrics")
        samples = {s.name: s.value for f in text_string_to_metric_families(page.text)
                   for s in f.samples if not s.labels}
        assert samples["obliviate_requests_pending"] == 1
        assert samples["obliviate_model_version"] == cur["seq"]
    assert sc.history("pending-1")["request"]["status"] == "received"
