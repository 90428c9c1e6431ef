"""NATS as deployed: the configurations Tollgate generates, as the real nats-server reads them.

`nats-server -t` parses a configuration, checks it (nkeys, permissions, TLS
files) and exits; these tests give it the files each deployment would.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import subprocess
import sysconfig
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.manifests import HELM, compose, of_kind, overlay_docs
from tollgate.app.busauth import Identities, TlsFiles, make_certificates, public_key, server_config
from tollgate.app.supervisor import nats_server_binary
from tollgate.wire.topology import Role

# where the NATS chart (1.x) puts things in the server's pod
CHART_CONFIG_DIR = "/etc/nats-config"
CHART_TLS_DIR = "/etc/nats-certs/nats"
CHART_CA_DIR = "/etc/nats-ca-cert"
RELOADER_WATCHES = "/etc/"  # reloader.natsVolumeMountPrefixes


def nats_test(*args: str) -> subprocess.CompletedProcess[str]:
    """`nats-server <args> -t`: check a configuration and exit."""
    return subprocess.run(
        [nats_server_binary(), *args, "-t"], capture_output=True, text=True, timeout=30
    )


def test_generated_auth_config_is_accepted_by_nats_server(tmp_path: Path) -> None:
    ids = Identities(tmp_path / "ids").ensure()
    ids.rotate(Role.ROUTER)  # a rotation in progress admits two router keys
    conf = tmp_path / "auth.conf"
    conf.write_text(server_config([ids]))
    out = nats_test("-c", str(conf))
    assert out.returncode == 0, out.stderr
    users = json.loads(conf.read_text().split("\n", 1)[1])["authorization"]["users"]
    assert len(users) == len(Role) + 1
    # and -t does check: a damaged key is refused
    conf.write_text(conf.read_text().replace('"nkey": "U', '"nkey": "X', 1))
    assert nats_test("-c", str(conf)).returncode != 0


def test_generated_tls_config_is_accepted_by_nats_server(tmp_path: Path) -> None:
    ids = Identities(tmp_path / "ids").ensure()
    files = make_certificates(tmp_path / "tls", ["nats", "*.nats-headless"])
    conf = tmp_path / "server.conf"
    conf.write_text(server_config([ids], TlsFiles(files.cert, files.key, files.ca)))
    out = nats_test("-c", str(conf))
    assert out.returncode == 0, out.stderr
    files.key.write_text("not a key\n")
    assert nats_test("-c", str(conf)).returncode != 0


def in_root(root: Path, path: str) -> Path:
    """An absolute path of the server's pod, inside a folder standing for its root."""
    return root / path.lstrip("/")


def chart_config(values: dict[str, Any], root: Path) -> Path:
    """nats.conf as the chart writes it from these values (the parts Tollgate sets).

    The chart renders its config as JSON and turns each `...$include` key into
    an `include PATH;` directive (nats.formatConfig).
    """
    config = values["config"]
    conf: dict[str, Any] = {"port": 4222, "server_name": "nats-0", "http_port": 8222}
    if config["jetstream"]["enabled"]:
        conf["jetstream"] = {"store_dir": str(root / "data")}
    if config.get("nats", {}).get("tls", {}).get("enabled"):
        tls = config["nats"]["tls"]
        directory = tls.get("dir", CHART_TLS_DIR)
        conf["tls"] = {
            "cert_file": str(in_root(root, f"{directory}/{tls.get('cert', 'tls.crt')}")),
            "key_file": str(in_root(root, f"{directory}/{tls.get('key', 'tls.key')}")),
        }
        if values.get("tlsCA", {}).get("enabled"):
            ca = values["tlsCA"]
            path = f"{ca.get('dir', CHART_CA_DIR)}/{ca.get('key', 'ca.crt')}"
            conf["tls"]["ca_file"] = str(in_root(root, path))
    conf.update(config.get("merge", {}))
    text = re.sub(r'".*\$include": "(.*)",?', r"include \1;", json.dumps(conf, indent=2))
    path = in_root(root, f"{CHART_CONFIG_DIR}/nats.conf")
    path.parent.mkdir(parents=True)
    path.write_text(text)
    return path


def helm_values(*names: str) -> dict[str, Any]:
    """Values files merged as `helm -f a -f b` merges them (maps deep, the rest replaced)."""

    def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        out = dict(a)
        for k, v in b.items():
            out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        return out

    merged: dict[str, Any] = {}
    for name in names:
        merged = merge(merged, yaml.safe_load((HELM / name).read_text()))
    return merged


def auth_mount(values: dict[str, Any]) -> tuple[str, str]:
    """(path of the generated file in the server's pod, its Secret) from the values' patches."""
    [include] = [v for k, v in values["config"]["merge"].items() if k.endswith("$include")]
    [mount] = [
        op["value"]
        for op in values["container"]["patch"]
        if op["op"] == "add" and op["path"] == "/volumeMounts/-"
    ]
    [volume] = [
        op["value"]
        for op in values["podTemplate"]["patch"]
        if op["op"] == "add" and op["path"] == "/spec/volumes/-"
    ]
    assert mount["name"] == volume["name"] and mount.get("readOnly") is True
    [item] = volume["secret"]["items"]
    # nats-server (Go's filepath.Join) and the chart's reloader put an include path
    # after the including file's folder, absolute or not
    path = posixpath.normpath(f"{CHART_CONFIG_DIR}/{include}")
    assert path == f"{mount['mountPath']}/{item['path']}", (include, mount, item)
    assert path.startswith(RELOADER_WATCHES), "the config reloader would not see a rotation"
    return path, volume["secret"]["secretName"]


@pytest.mark.parametrize(
    "files", [["nats-values.yaml"], ["nats-values.yaml", "nats-values-tls.yaml"]], ids=["", "tls"]
)
def test_helm_values_give_nats_the_generated_identities(tmp_path: Path, files: list[str]) -> None:
    values = helm_values(*files)
    root = tmp_path / "pod"
    path, secret = auth_mount(values)
    assert secret == "tollgate-nats-auth"
    ids = Identities(tmp_path / "ids").ensure()
    auth = in_root(root, path)
    auth.parent.mkdir(parents=True)
    auth.write_text(server_config([ids]))
    if "tls" in values["config"].get("nats", {}):
        tls = make_certificates(tmp_path / "tls", ["nats", "*.nats-headless"])
        for source, target in [
            (tls.cert, f"{CHART_TLS_DIR}/tls.crt"),
            (tls.key, f"{CHART_TLS_DIR}/tls.key"),
            (tls.ca, f"{CHART_CA_DIR}/ca.crt"),
        ]:
            in_root(root, target).parent.mkdir(parents=True, exist_ok=True)
            in_root(root, target).write_text(source.read_text())
    conf = chart_config(values, root)
    out = nats_test("-c", str(conf))
    assert out.returncode == 0, (conf.read_text(), out.stderr)
    # the server reads the mounted file: without it, no start
    auth.unlink()
    assert nats_test("-c", str(conf)).returncode != 0


def test_the_include_check_catches_a_path_the_server_would_not_find() -> None:
    values = helm_values("nats-values.yaml")
    values["config"]["merge"]["00$include"] = "/etc/tollgate-nats-auth/auth.conf"
    with pytest.raises(AssertionError):
        auth_mount(values)


def test_prod_clients_trust_the_ca_the_nats_servers_are_given() -> None:
    tls = helm_values("nats-values.yaml", "nats-values-tls.yaml")
    assert tls["config"]["nats"]["tls"]["enabled"] and tls["config"]["cluster"]["tls"]["enabled"]
    assert (
        tls["config"]["nats"]["tls"]["secretName"] == tls["config"]["cluster"]["tls"]["secretName"]
    )
    docs = overlay_docs("prod")
    config = of_kind(docs, "ConfigMap")["tollgate-config"]["data"]
    assert config["TOLLGATE_NATS_URL"].startswith("tls://")
    ca_file = config["TOLLGATE_NATS_TLS_CA"]
    for name, dep in of_kind(docs, "Deployment").items():
        pod = dep["spec"]["template"]["spec"]
        [container] = pod["containers"]
        [mount] = [m for m in container["volumeMounts"] if ca_file.startswith(m["mountPath"] + "/")]
        [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        # the clients' CA is the servers' (a ConfigMap: no private key travels with it)
        assert volume["configMap"]["name"] == tls["tlsCA"]["configMapName"], name
        [item] = volume["configMap"]["items"]
        assert item["key"] == tls["tlsCA"]["key"], name
        assert posixpath.join(mount["mountPath"], item["path"]) == ca_file, name


# ---------------------------------------------------------------- compose


def bus_init(volume: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """compose's bus-init script, run here with `volume` as its volume."""
    svc = compose()["services"]["bus-init"]
    shell, flags, script, name = svc["entrypoint"]
    script = script.replace("$$", "$").replace("/var/lib/tollgate", str(volume))
    env = dict(os.environ, PREFIX="tg")
    env["PATH"] = f"{sysconfig.get_path('scripts')}{os.pathsep}{env['PATH']}"
    return subprocess.run(
        [shell, flags, script, name, *args], capture_output=True, text=True, timeout=60, env=env
    )


def test_compose_bus_init_writes_what_nats_and_each_service_read(tmp_path: Path) -> None:
    spec = compose()
    services = spec["services"]
    volume = tmp_path / "bus"
    volume.mkdir()
    out = bus_init(volume)
    assert out.returncode == 0, out.stderr
    auth = volume / "nats" / "auth.conf"
    admitted = set(re.findall(r'"nkey": "(U[A-Z0-9]+)"', auth.read_text()))
    for name, svc in services.items():
        for mount in svc.get("volumes", []):
            if not isinstance(mount, dict) or mount["source"] != "bus":
                continue
            folder = volume / mount["volume"]["subpath"]
            for key, value in (svc.get("environment") or {}).items():
                if key.endswith("NKEY_FILE") and value:
                    seed = folder / Path(value).relative_to(mount["target"])
                    assert public_key(seed.read_text()) in admitted, (name, key)
                    assert seed.stat().st_mode & 0o077 == 0, f"{name}: {seed} readable by others"
    # NATS, started as compose starts it, accepts the file
    nats = services["nats"]
    [mount] = [m for m in nats["volumes"] if isinstance(m, dict)]
    args = [
        str(volume / mount["volume"]["subpath"] / Path(a).relative_to(mount["target"]))
        if a.startswith(mount["target"] + "/")
        else str(tmp_path / "data")
        if a == "/data"
        else a
        for a in nats["command"]
    ]
    result = nats_test(*args)
    assert result.returncode == 0, result.stderr
    assert auth.stat().st_mode & 0o444 == 0o444, "NATS runs as another user"
    # a rotation: the new router key joins, the old one stays until retired
    before = public_key((volume / "router" / "nkey").read_text())
    assert bus_init(volume, "--rotate", "router").returncode == 0
    after = public_key((volume / "router" / "nkey").read_text())
    assert after != before and {before, after} <= set(
        re.findall(r'"nkey": "(U[A-Z0-9]+)"', auth.read_text())
    )
    assert bus_init(volume, "--retire", "router").returncode == 0
    assert before not in auth.read_text() and after in auth.read_text()
    assert nats_test(*args).returncode == 0
