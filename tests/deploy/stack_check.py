"""`make test-deploy`: start deploy/compose.yaml from the built images and hold it to its
promises, then break it: PostgreSQL, the broker, a worker and a service replica killed
(SIGKILL to the container's process; Docker's restart policy brings it back), and the
model store's volume filled until a publish fails. Per fault: lost and doubled requests,
unsound answers, the time until the sidecar resumes by itself, the alert Prometheus fired.
Standard library only (the host needs no venv); prints RESULT lines last.
See docs/operations.md (Testing the deployment).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
WORK = ROOT / "build" / "deploy" / "check"
PROJECT = "obliviate"
SERVICES = ["http://127.0.0.1:13000", "http://127.0.0.1:13001"]
PROM = "http://127.0.0.1:19090"
# the deployment's key store and model store, for the command line's containers
VOLUMES = (f"{PROJECT}_keys:/keys", f"{PROJECT}_models:/models")
PG = ["psql", "-h", "127.0.0.1", "-p", "15432", "-U", "obliviate", "-d", "obliviate", "-At"]
# the alert that must fire for each fault (read from Prometheus after it)
FAULTS = {"postgres": "WorkerPassesFailing", "broker": "RequestLogStartedAgain",
          "worker": "ObliviateTargetDown", "service": "ObliviateTargetDown",
          "model-store-full": "WorkerPassesFailing"}
RECOVERY_LIMIT_S = 180


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sh(*cmd: str, check: bool = True, env: dict[str, str] | None = None,
       timeout: float = 900) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} -> {out.returncode}\n{out.stdout}\n{out.stderr}")
    return out.stdout


class Stack:
    """The compose project: its secrets, its containers, its command line from outside."""

    def __init__(self) -> None:
        self.env = dict(os.environ, POSTGRES_PASSWORD=secrets.token_hex(12),
                        OBLIVIATE_HMAC_KEY_HEX=secrets.token_hex(32),
                        OBLIVIATE_ADMIN_TOKEN=secrets.token_hex(24),
                        OBLIVIATE_LEDGER_SIGNING_KEY_HEX=secrets.token_hex(32))
        self.compose = ["docker-compose", "-p", PROJECT, "-f", str(ROOT / "deploy/compose.yaml"),
                        "-f", str(ROOT / "tests/deploy/compose.check.yaml")]

    def run(self, *args: str, check: bool = True, timeout: float = 900) -> str:
        return sh(*self.compose, *args, check=check, env=self.env, timeout=timeout)

    def container(self, service: str) -> str:
        return self.run("ps", "-q", service).strip()

    def cli(self, *args: str, mounts: tuple[str, ...] = ()) -> str:
        """`obliviate ...` in a fresh container of the image: outside every running process."""
        env = [f"-e{k}" for k in ("OBLIVIATE_DATABASE_URL", "OBLIVIATE_HMAC_KEY_HEX",
                                  "OBLIVIATE_LEDGER_SIGNING_KEY_HEX", "OBLIVIATE_KAFKA_BOOTSTRAP",
                                  "OBLIVIATE_KEY_STORE_DIR", "OBLIVIATE_MODEL_STORE")]
        vols = [f"-v{m}" for m in (*VOLUMES, *mounts)]
        return sh("docker", "run", "--rm", "--network", "host", *env, *vols, "obliviate:latest",
                  *args, env=self.cli_env())

    def cli_env(self) -> dict[str, str]:
        return dict(self.env, OBLIVIATE_DATABASE_URL="postgresql+psycopg://obliviate:"
                    f"{self.env['POSTGRES_PASSWORD']}@127.0.0.1:15432/obliviate",
                    OBLIVIATE_KAFKA_BOOTSTRAP="127.0.0.1:19092", OBLIVIATE_KEY_STORE_DIR="/keys",
                    OBLIVIATE_MODEL_STORE="/models")

    def sql(self, query: str) -> str:
        return sh("docker", "exec", "-e", f"PGPASSWORD={self.env['POSTGRES_PASSWORD']}",
                  self.container("postgres"), *PG, "-c", query, check=False).strip()

    def kill(self, service: str) -> None:
        """SIGKILL the container's main process: a crash, which the restart policy answers."""
        pid = sh("docker", "inspect", "-f", "{{.State.Pid}}", self.container(service)).strip()
        os.kill(int(pid), 9)


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=3) as r:
            return r.status == 200
    except OSError:
        return False


def wait(what: str, ok: Any, limit_s: float = 600) -> float:
    t0 = time.monotonic()
    while not ok():
        if time.monotonic() - t0 > limit_s:
            raise RuntimeError(f"{what}: not within {limit_s} s")
        time.sleep(0.5)
    return time.monotonic() - t0


def prom(query: str) -> list[dict[str, Any]]:
    url = f"{PROM}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.load(r)["data"]["result"]


def prometheus_config() -> Path:
    """The repo's scrape config and rules, with 2 s intervals and `for:` cut to 4 s so a
    fault's alert fires within the check (the expressions are the repo's own)."""
    out = WORK / "prometheus"
    out.mkdir(parents=True, exist_ok=True)
    conf = (ROOT / "deploy/prometheus/prometheus.yml").read_text()
    (out / "prometheus.yml").write_text(re.sub(r"(scrape|evaluation)_interval: \S+",
                                               r"\1_interval: 2s", conf))
    rules = (ROOT / "deploy/prometheus/alerts.yml").read_text()
    (out / "alerts.yml").write_text(re.sub(r"for: \S+", "for: 4s", rules))
    return out


def start(stack: Stack) -> dict[str, float]:
    """From nothing to ready: the infrastructure, the ledger and model v1, the sidecar."""
    times: dict[str, float] = {}
    stack.run("down", "-v", "--remove-orphans", check=False)
    t0 = time.monotonic()
    # a worker first: it holds the tmpfs model store mounted (a volume nothing mounts is
    # unmounted, and `model train` below runs in a container that exits)
    stack.run("up", "-d", "postgres", "broker", "prometheus", "worker")
    wait("postgres", lambda: stack.sql("SELECT 1") == "1")
    times["infra_s"] = time.monotonic() - t0
    t1 = time.monotonic()
    stack.cli("ledger", "init", "--dataset", "breast_cancer")
    stack.cli("model", "train")
    times["init_train_s"] = time.monotonic() - t1
    t2 = time.monotonic()
    stack.run("up", "-d")
    for url in SERVICES:
        wait(url, lambda u=url: http_ok(f"{u}/readyz"))
    for port in (19101, 19111, 19102):
        wait(f"metrics :{port}", lambda p=port: http_ok(f"http://127.0.0.1:{p}/metrics"))
    times["sidecar_ready_s"] = time.monotonic() - t2
    times["total_s"] = time.monotonic() - t0
    return times


def stream(stack: Stack, prefix: str, seconds: float) -> subprocess.Popen[str]:
    """tests/deploy/stream.py in a container of the image, in the background."""
    env = stack.cli_env()
    keys = [f"-e{k}" for k in ("OBLIVIATE_DATABASE_URL", "OBLIVIATE_KAFKA_BOOTSTRAP",
                               "OBLIVIATE_HMAC_KEY_HEX", "OBLIVIATE_LEDGER_SIGNING_KEY_HEX",
                               "OBLIVIATE_KEY_STORE_DIR", "OBLIVIATE_MODEL_STORE")]
    vols = [f"-v{m}" for m in VOLUMES]
    return subprocess.Popen(
        ["docker", "run", "--rm", "--network", "host", *keys, *vols, "-v",
         f"{ROOT / 'tests/deploy'}:/check:ro", "--entrypoint", "python", "obliviate:latest",
         "/check/stream.py", "--prefix", prefix, "--seconds", str(seconds)],
        stdout=subprocess.PIPE, text=True, env=env)


def finish(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, _ = proc.communicate(timeout=600)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"stream failed ({proc.returncode}): {out[-2000:]}")
    return json.loads(lines[-1])


def checks(stack: Stack, heads: Path) -> dict[str, Any]:
    """From outside: the ledger verifies, the log holds to the saved heads, Prometheus
    scraped every target and has the budget and latency series, the audit page answers."""
    res: dict[str, Any] = {}
    stack.cli("ledger", "verify")
    res["ledger_verify"] = "ok"
    stack.cli("audit", "check", "--heads", "/heads/heads.json", "--url", SERVICES[0],
              mounts=(f"{heads.parent}:/heads:ro",))
    res["audit_check"] = "ok"
    with urllib.request.urlopen(f"{PROM}/api/v1/targets", timeout=5) as r:
        targets = json.load(r)["data"]["activeTargets"]
    res["targets_up"] = sum(t["health"] == "up" for t in targets)
    res["targets"] = len(targets)
    res["budget_series"] = len(prom("obliviate_guard_epsilon_spent_total"))
    res["latency_series"] = len(prom("obliviate_deletion_latency_seconds_count > 0"))
    res["audit_page"] = http_ok(f"{SERVICES[1]}/audit")
    if (res["targets_up"] != res["targets"] or not res["budget_series"]
            or not res["latency_series"] or not res["audit_page"]):
        raise RuntimeError(f"checks failed: {res}")
    return res


def inject(stack: Stack, name: str) -> Any:
    """Break one part; returns the test that says it is back."""
    if name == "model-store-full":
        fill = ["docker", "exec", stack.container("worker"), "sh", "-c"]
        sh(*fill, "dd if=/dev/zero of=/models/fill bs=1M 2>/dev/null; true")
        failed = "sum(increase(obliviate_worker_pass_errors_total[1m]))" \
                 " + sum(increase(obliviate_update_failures_total[1m])) > 0"
        wait("a publish fails on a full store", lambda: bool(prom(failed)), 120)
        sh(*fill, "rm -f /models/fill")
        return lambda: True
    service = {"service": "service-2"}.get(name, name)
    stack.kill(service)
    time.sleep(1)
    return {"postgres": lambda: stack.sql("SELECT 1") == "1",
            "broker": lambda: port_open(19092),
            "worker": lambda: http_ok("http://127.0.0.1:19101/metrics"),
            "service": lambda: http_ok(f"{SERVICES[1]}/readyz")}[name]


def port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def fault(stack: Stack, name: str) -> dict[str, Any]:
    """One fault with the stream running: back, resumed, nothing lost, the alert fired."""
    proc = stream(stack, f"fault-{name}", 30)
    assert proc.stdout is not None
    while proc.stdout.readline().strip() != "streaming":  # its setup done (or it failed)
        if proc.poll() is not None:
            raise RuntimeError(f"the stream for {name} ended before streaming")
    time.sleep(8)
    t_fault, t0 = time.time(), time.monotonic()
    log(f"fault {name}")
    back = inject(stack, name)
    wait(f"{name} back", back, RECOVERY_LIMIT_S)
    back_s = time.monotonic() - t0
    verified_after = ("SELECT count(*) FROM requests WHERE status = 'verified' AND "
                      f"received_at > to_timestamp({time.time():.3f})")
    wait(f"a request sent after {name} verified",
         lambda: stack.sql(verified_after) not in ("", "0"), RECOVERY_LIMIT_S)
    resumed_s = time.monotonic() - t0
    summary = finish(proc)
    window = max(60, int(time.time() - t_fault) + 10)
    alert = FAULTS[name]
    seen = {state: bool(prom(f'max_over_time(ALERTS{{alertname="{alert}",'
                             f'alertstate="{state}"}}[{window}s])'))
            for state in ("firing", "pending")}
    res = {"fault": name, "back_s": round(back_s, 1), "resumed_s": round(resumed_s, 1),
           "lost": summary["lost"], "doubled": summary["doubled"],
           "unfinished": summary["unfinished"], "unsound": summary["answers_unsound"],
           "answers": summary["answers"], "answers_ok": summary["answers_ok"],
           "requests": summary["acked"], "resent": summary["resent"], "alert": alert,
           "fired": int(seen["firing"]), "pending": int(seen["pending"])}
    log(json.dumps(res))
    if summary["unsound_examples"]:
        log(f"unsound answers: {summary['unsound_examples']}")
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--faults", default=",".join(FAULTS), help="comma-separated subset")
    p.add_argument("--keep", action="store_true", help="leave the stack running")
    args = p.parse_args()
    prometheus_config()
    stack = Stack()
    ok = True
    try:
        times = start(stack)
        log(f"started: {json.dumps({k: round(v, 1) for k, v in times.items()})}")
        heads = WORK / "heads" / "heads.json"
        heads.parent.mkdir(parents=True, exist_ok=True)
        base = finish(stream(stack, "steady", 20))
        log(f"steady stream: {json.dumps(base)}")
        heads.write_text(stack.cli("ledger", "heads"))
        ok &= base["lost"] == base["doubled"] == base["unfinished"] == 0 \
            and base["answers_unsound"] == 0
        results = [fault(stack, name) for name in args.faults.split(",") if name]
        res = checks(stack, heads)
        log(f"checks: {json.dumps(res)}")
        for r in results:
            # a part back before the rule's `for:` (4 s here) leaves the alert pending:
            # its expression saw the fault, and a restart that quick pages no one
            ok &= (r["lost"] == r["doubled"] == r["unfinished"] == r["unsound"] == 0
                   and (r["fired"] or r["pending"]) and r["resumed_s"] < RECOVERY_LIMIT_S)
            print("RESULT " + " ".join(f"{k}={v}" for k, v in r.items()))
        print("RESULT " + " ".join(f"{k}={round(v, 1)}" for k, v in times.items()))
        print(f"RESULT steady_requests={base['acked']} steady_lost={base['lost']} "
              f"steady_doubled={base['doubled']} steady_unsound={base['answers_unsound']} "
              f"ledger_verify={res['ledger_verify']} audit_check={res['audit_check']} "
              f"targets_up={res['targets_up']}/{res['targets']}")
    except Exception as exc:  # noqa: BLE001 - reported, then the stack's logs
        ok = False
        log(f"FAILED: {exc}")
        sys.stdout.write(stack.run("logs", "--tail", "10", check=False))
    finally:
        if not args.keep:
            stack.run("down", "-v", "--remove-orphans", check=False)
    print(f"RESULT test_deploy={'pass' if ok else 'fail'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
