"""`obliviate build` makes a real Bento of the service, which is complete and serves.

One Bento is built for the module (the repository's bentofile.yaml, a temporary
BENTOML_HOME and model store, a small SISA version). It is held to three things:

- its own sources are complete: a fresh interpreter that sees the Bento's `src` and
  the third-party packages, but not the project (``python -S``: no ``.pth`` file runs,
  so the editable install's finder is never installed), imports the service, opens a
  ledger (running the migrations from the Bento's own files) and every module of the
  three packages, each from `src`;
- it serves: exported, imported into another home, `bentoml serve` answers a guarded
  prediction with raw features (its own copy of the version, the model store empty);
- it holds this ledger's current version, under a tag naming the ledger (BentoML's
  own store is every ledger's: another ledger's v000001 is not this one).
"""

from __future__ import annotations

import json
import os
import re
import site
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from service.demo.processes import ManagedProcess, free_port

# `bentoml build`, a fresh interpreter and `bentoml serve`: processes
pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parent.parent
BENTOML = str(Path(sys.executable).parent / "bentoml")
PACKAGES = ("ledger", "jobs", "service")


def _requirement_names(reqs: list[str]) -> dict[str, str]:
    return {re.split(r"[\[<>=!~ ]", r, maxsplit=1)[0].lower(): r for r in reqs}


def test_bentofile_requirements_match_the_project() -> None:
    bentofile = yaml.safe_load((ROOT / "bentofile.yaml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert bentofile["python"]["packages"] == project["dependencies"]
    assert "alembic" in _requirement_names(project["dependencies"])
    assert bentofile["service"] == "service.service:Obliviate"
    assert bentofile["python"]["lock_packages"] is False  # building must not need a network


class Built:
    def __init__(self, tmp: Path, env: dict[str, str], tag: str) -> None:
        self.tmp, self.env, self.tag = tmp, env, tag
        self.path = tmp / "bentoml" / "bentos" / "obliviate" / tag

    def run(self, *args: str, env: dict[str, str] | None = None) -> str:
        out = subprocess.run(args, env={**os.environ, **(env or self.env)}, cwd=ROOT,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
        return out.stdout


@pytest.fixture(scope="module")
def bento(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    tmp = tmp_path_factory.mktemp("bento")
    env = {"BENTOML_HOME": str(tmp / "bentoml"), "BENTOML_DO_NOT_TRACK": "true",
           "OBLIVIATE_MODEL_STORE": str(tmp / "models"),
           "OBLIVIATE_DATABASE_URL": f"sqlite:///{tmp / 'ledger.db'}",
           "OBLIVIATE_HMAC_KEY_FILE": str(tmp / "hmac.key"),
           "OBLIVIATE_LEDGER_SIGNING_KEY_FILE": str(tmp / "signing.key"),
           "OBLIVIATE_ADMIN_TOKEN": "t" * 32,
           "PROMETHEUS_MULTIPROC_DIR": str(tmp / "prom")}
    (tmp / "prom").mkdir()
    built = Built(tmp, env, "")
    obliviate = (sys.executable, "-m", "service.cli")
    built.run(*obliviate, "ledger", "init", "--dataset", "breast_cancer")
    built.run(*obliviate, "model", "train", "--learner", "sisa",
              "--params", '{"n_shards": 3, "epochs_per_slice": 5}')
    built.run(*obliviate, "build")  # the repository's bentofile.yaml
    bentos = tmp / "bentoml" / "bentos" / "obliviate"
    [tag] = [p.name for p in bentos.iterdir() if p.name != "latest"]
    yield Built(tmp, env, tag)


@pytest.mark.slow
def test_the_bentos_own_sources_are_complete(bento: Built, tmp_path: Path) -> None:
    src = bento.path / "src"
    shipped = {p.relative_to(src).as_posix() for pkg in PACKAGES
               for p in (src / pkg).rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    demo = ROOT / "service" / "demo"  # the demo's tooling: excluded by bentofile.yaml
    repo = {p.relative_to(ROOT).as_posix() for pkg in PACKAGES for p in (ROOT / pkg).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and not p.is_relative_to(demo)
            and (p.suffix == ".py" or p.name == "script.py.mako" or "audit" in p.parts)}
    assert repo - shipped == set(), f"missing from the Bento: {sorted(repo - shipped)}"
    assert not any(s.startswith("service/demo/") for s in shipped), "demo tooling shipped"

    # the third-party packages only: site-packages without the project's .pth files,
    # which python -S never runs (the editable finder stays out)
    third_party = [p for p in site.getsitepackages() if Path(p).is_dir()]
    modules = sorted(".".join(p.relative_to(src).with_suffix("").parts).removesuffix(
        ".__init__") for pkg in PACKAGES for p in (src / pkg).rglob("*.py")
        if "versions" not in p.parts and p.name != "env.py")
    probe = f"""
import importlib, json, sys
sys.path[:0] = [{str(src)!r}, *{third_party!r}]
import service.service  # the Bento's service, as `bentoml serve` would import it
from ledger.store import Ledger
led = Ledger({f"sqlite:///{tmp_path / 'probe.db'}"!r}, bytes(32))  # runs the migrations
assert led.schema_upgrade.created, led.schema_upgrade
for name in {modules!r}:
    importlib.import_module(name)
ours = {{n: getattr(m, "__file__", None) for n, m in sys.modules.items()
        if n.split(".")[0] in {PACKAGES!r}}}
print(json.dumps({{"ours": ours, "editable": any("editable" in n for n in sys.modules),
                  "service": service.service.Obliviate.name}}))
"""
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "BENTOML_DO_NOT_TRACK": "true",
           "BENTOML_HOME": str(tmp_path / "home"),
           "OBLIVIATE_HMAC_KEY_FILE": str(tmp_path / "hmac.key"),
           "OBLIVIATE_LEDGER_SIGNING_KEY_FILE": str(tmp_path / "signing.key"),
           "OBLIVIATE_DATABASE_URL": f"sqlite:///{tmp_path / 'svc.db'}"}
    out = subprocess.run([sys.executable, "-S", "-c", probe], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["service"] == "obliviate" and not result["editable"]
    outside = {n: f for n, f in result["ours"].items()
               if f is None or not Path(f).resolve().is_relative_to(src.resolve())}
    assert not outside, f"imported from outside the Bento: {outside}"
    assert {"service.service", "jobs.adaptive.budget", "jobs.eval", "ledger.migrations",
            "jobs.orchestration.served_model"} <= set(result["ours"])


@pytest.mark.slow
def test_the_built_bento_serves_a_guarded_prediction(bento: Built) -> None:
    # the Bento holds the code and the requirements, and names the current version
    info = yaml.safe_load((bento.path / "bento.yaml").read_text())
    [tag] = [m["tag"] for m in info["models"]]
    scope = next((bento.tmp / "models").glob("*/obliviate/v000001")).parent.parent.name
    assert tag == f"obliviate:v000001-{scope}"
    assert (bento.path / "src" / "service" / "audit" / "index.html").exists()
    # ... and carries it: exported, then imported into a fresh home with no models
    bundle = bento.tmp / "obliviate.bento"
    bento.run(BENTOML, "export", f"obliviate:{bento.tag}", str(bundle))
    env = {**bento.env, "BENTOML_HOME": str(bento.tmp / "elsewhere"),
           "OBLIVIATE_MODEL_STORE": str(bento.tmp / "no-models")}
    bento.run(BENTOML, "import", str(bundle), env=env)
    assert (bento.tmp / "elsewhere" / "models" / "obliviate" / tag.split(":")[1] /
            "manifest.json").exists()

    from ledger.datasets import load

    raw = load("breast_cancer").raw
    port = free_port()
    server = ManagedProcess(["serve", f"obliviate:{bento.tag}", "--port", str(port)], env,
                            bento.tmp / "bento-serve.log", program=(BENTOML,), cwd=bento.tmp)
    try:
        server.wait_http(f"http://127.0.0.1:{port}/readyz", timeout_s=120)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/predict",
                       json={"instances": raw[:2].tolist()}, timeout=30)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model_version"] == "v000001" and body["guard"] == "sound"
        assert set(body) == {"labels", "model_version", "guard", "promises"}  # no scores
        assert all(label in (0, 1) for label in body["labels"])
        schema = httpx.get(f"http://127.0.0.1:{port}/v1/schema", timeout=30).json()
        assert schema["features"][0]["name"] == "mean radius"
    finally:
        assert server.stop() == 0, server.log_tail()
