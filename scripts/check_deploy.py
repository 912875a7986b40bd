#!/usr/bin/env python3
"""Checks deploy/kubernetes/kvtier-sidecar.yaml as far as a machine without a cluster allows.

1. Every resource validates (strictly: no unknown fields) against Kubernetes' own OpenAPI
   schemas, with the kubernetes-validate package; a copy with a misspelt field must fail, so
   the check can fail.
2. The ConfigMap's kvtier.toml loads: `kvtier serve --config <it> --print-config`, and its
   socket and disk directory are where the pod mounts its volumes.
3. The pod's start, replayed on this machine with the manifest's own uid, gid and commands:
   the disk directory is created the way the kubelet creates a hostPath (root, 0755), the
   init container's command runs as root, then `kvtier serve` runs as the pod's uid with the
   manifest's config (paths mapped into a temporary root; the host tier and disk sizes scaled
   down), and the startup probe's command, run as that uid, must pass. Without the init step
   the same serve must fail with "Permission denied", which is what the step is for.
   This part needs root (to create root-owned directories and switch uid); without root it
   is reported as not run and the script fails, unless KVTIER_DEPLOY_CHECK_NO_ROOT=skip.

Usage: python3 scripts/check_deploy.py path/to/kvtier   (the binary to run)
"""

from __future__ import annotations

import copy
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = ROOT / "deploy/kubernetes/kvtier-sidecar.yaml"
K8S_VERSION = "1.32.0"


def fail(msg: str) -> None:
    print(f"check_deploy: FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


def ok(msg: str) -> None:
    print(f"check_deploy: ok: {msg}")


def validate(docs: list[dict[str, Any]]) -> None:
    for d in docs:
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)
        ok(f"{d['kind']}/{d['metadata']['name']} validates against Kubernetes {K8S_VERSION} (strict)")
    broken = copy.deepcopy(next(d for d in docs if d["kind"] == "Pod"))
    broken["spec"]["securityContext"]["runAsUserr"] = 1000
    try:
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError:
        ok("a misspelt field is refused by the validator")
    else:
        fail("the validator accepted a misspelt field: it checks nothing")


def container(pod: dict[str, Any], name: str, init: bool = False) -> dict[str, Any]:
    key = "initContainers" if init else "containers"
    for c in pod["spec"].get(key, []):
        if c["name"] == name:
            return c
    fail(f"no {key[:-1]} named {name}")
    raise AssertionError


def mounts(pod: dict[str, Any], c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """mountPath -> volume, for container c."""
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    return {m["mountPath"]: volumes[m["name"]] for m in c.get("volumeMounts", [])}


def print_config(kvtier: str, config: Path, env: dict[str, str] | None = None) -> str:
    r = subprocess.run([kvtier, "serve", "--config", str(config), "--print-config"],
                       capture_output=True, text=True, env=env)
    if r.returncode != 0:
        fail(f"kvtier serve --print-config on the ConfigMap's kvtier.toml: {r.stderr.strip()}")
    return r.stdout


def replay_pod_start(kvtier: str, pod: dict[str, Any], toml_text: str) -> None:
    sc = pod["spec"]["securityContext"]
    uid, gid = sc["runAsUser"], sc["runAsGroup"]
    side = container(pod, "kvtier")
    init = container(pod, "kvtier-disk-owner", init=True)
    side_mounts = mounts(pod, side)
    disk_mount = next(p for p, v in side_mounts.items() if "hostPath" in v)
    host_path = side_mounts[disk_mount]["hostPath"]
    if host_path.get("type") != "DirectoryOrCreate":
        fail(f"hostPath {host_path} is not DirectoryOrCreate")
    if disk_mount not in mounts(pod, init):
        fail(f"the init container does not mount {disk_mount}")
    socket_mount = next(p for p, v in side_mounts.items() if "emptyDir" in v and p != "/dev/shm")

    with tempfile.TemporaryDirectory(prefix="kvtier-deploy-") as tmp:
        root = Path(tmp)
        os.chmod(root, 0o755)

        def at(p: str) -> str:
            return str(root / p.lstrip("/"))

        # The binary where the pod's user may run it.
        exe = root / "kvtier"
        shutil.copy(kvtier, exe)
        os.chmod(exe, 0o755)
        # Volumes as the kubelet makes them: the emptyDir with fsGroup group-owned and setgid,
        # the hostPath root-owned 0755, the ConfigMap read-only.
        for p, v in side_mounts.items():
            d = Path(at(p))
            d.mkdir(parents=True, exist_ok=True)
            if "emptyDir" in v:
                os.chown(d, 0, sc.get("fsGroup", gid))
                os.chmod(d, 0o2775)
            else:
                os.chown(d, 0, 0)
                os.chmod(d, 0o755)
        config = Path(at("/etc/kvtier/kvtier.toml"))
        mapped = toml_text
        for p in side_mounts:
            if p != "/etc/kvtier":
                mapped = mapped.replace(f'"{p}', f'"{at(p)}')
        config.write_text(mapped)
        os.chmod(config, 0o444)
        env = {
            "PATH": f"{root}:/usr/bin:/bin",
            # The shipped sizes (tens of GiB) are the node's; this machine gets small ones.
            "KVTIER_HOST__CAPACITY": "64MiB",
            "KVTIER_DISK__CAPACITY": "1GiB",
            "KVTIER_SERVER__METRICS": "off",
            "KVTIER_LOG": "warn",
        }
        serve_args = [str(exe)] + [a.replace("/etc/kvtier", at("/etc/kvtier")) for a in side["args"]]
        as_pod = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups"]

        # Without the init step: the failure the manifest must prevent.
        r = subprocess.run(as_pod + serve_args, capture_output=True, text=True, env=env, timeout=60)
        if r.returncode == 0 or "Permission denied" not in r.stderr:
            fail(f"without the init step serve should fail on the root-owned hostPath: rc={r.returncode} {r.stderr.strip()}")
        ok(f"without the init step: {r.stderr.strip().splitlines()[-1]}")

        # The init container's command, as root, on the mapped path.
        cmd = [a.replace(disk_mount, at(disk_mount)) for a in init["command"]]
        subprocess.run(cmd, check=True)
        st = os.stat(at(disk_mount))
        if (st.st_uid, st.st_gid) != (uid, gid):
            fail(f"after the init step the disk directory is {st.st_uid}:{st.st_gid}, not {uid}:{gid}")
        ok(f"init step: the disk directory is {uid}:{gid} mode {oct(st.st_mode & 0o7777)}")

        proc = subprocess.Popen(as_pod + serve_args, stderr=subprocess.PIPE, text=True, env=env)
        try:
            assert proc.stderr is not None
            line = proc.stderr.readline()
            if "kvtier: serving" not in line:
                fail(f"serve as uid {uid}: {line}{proc.stderr.read() if proc.poll() is not None else ''}")
            ok(f"serve as uid {uid}: {line.strip()}")
            probe = side["startupProbe"]["exec"]["command"]
            probe = [str(exe)] + [a.replace(socket_mount, at(socket_mount)) for a in probe[1:]]
            r = subprocess.run(as_pod + probe, capture_output=True, text=True, env=env, timeout=30)
            if r.returncode != 0:
                fail(f"startup probe as uid {uid}: {r.stdout}{r.stderr}")
            ok(f"startup probe as uid {uid}: {r.stdout.strip()}")
            sock = Path(at(socket_mount)) / "kvtier.sock"
            mode = os.stat(sock).st_mode & 0o777
            if mode != 0o600:
                fail(f"the socket is mode {oct(mode)}, not 0600")
            if not (Path(at(disk_mount)) / "LOCK").exists():
                fail("the disk tier holds no LOCK file in the hostPath directory")
            ok("socket 0600 in the shared emptyDir; disk tier locked in the hostPath")
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                rc = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                fail("serve did not stop within 30 s of SIGTERM")
        if rc != 0:
            fail(f"serve exited {rc} after SIGTERM")
        ok("SIGTERM: clean exit")


def check_systemd_unit(kvtier: str) -> None:
    """The unit passes `systemd-analyze verify` (with ExecStart pointing at this binary) and
    declares what docs/api.md promises: Type=notify, the service user and group."""
    unit = (ROOT / "deploy/systemd/kvtier.service").read_text()
    for want in ["Type=notify", "NotifyAccess=main", "User=kvtier", "Group=kvtier", "RuntimeDirectoryMode=0750"]:
        if want not in unit:
            fail(f"deploy/systemd/kvtier.service lacks {want}")
    for step in ["useradd", "/etc/kvtier", 'socket_mode = "0660"', "usermod -aG kvtier"]:
        if step not in unit:
            fail(f"the unit's install notes lack {step!r}")
    ok("systemd unit: Type=notify, service user, install notes (user, /etc/kvtier, socket group)")
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        print("check_deploy: NOT RUN: systemd-analyze verify (no systemd-analyze on this machine)")
        return
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "kvtier.service"
        f.write_text(unit.replace("/usr/local/bin/kvtier", kvtier))
        r = subprocess.run([analyze, "verify", str(f)], capture_output=True, text=True)
        if r.returncode != 0 or r.stderr.strip():
            fail(f"systemd-analyze verify: {r.stdout}{r.stderr}")
    ok("systemd-analyze verify passes")
    r = subprocess.run([kvtier, "serve", "--config", str(ROOT / "deploy/kvtier.toml"), "--print-config"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        fail(f"deploy/kvtier.toml does not load: {r.stderr}")
    ok("deploy/kvtier.toml loads (--print-config)")


def main() -> None:
    if len(sys.argv) != 2:
        fail("usage: check_deploy.py path/to/kvtier")
    kvtier = str(Path(sys.argv[1]).resolve())
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    validate(docs)
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    pod = next(d for d in docs if d["kind"] == "Pod")
    toml_text = cm["data"]["kvtier.toml"]

    side = container(pod, "kvtier")
    side_mounts = mounts(pod, side)
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "kvtier.toml"
        f.write_text(toml_text)
        printed = print_config(kvtier, f)
    for key, want_under in [("socket", "/run/kvtier"), ("dir", "/var/cache/kvtier")]:
        line = next((ln for ln in printed.splitlines() if ln.startswith(f"{key} = ")), "")
        if f'"{want_under}/' not in line and f'"{want_under}"' not in line:
            fail(f"--print-config shows {line!r}, not under {want_under}")
        if want_under not in side_mounts:
            fail(f"the kvtier container does not mount {want_under}")
    ok("the ConfigMap's kvtier.toml loads (--print-config); socket and disk dir are on mounted volumes")

    probe = side.get("startupProbe")
    if not probe:
        fail("the kvtier container has no startupProbe")
    allowed_s = probe["periodSeconds"] * probe["failureThreshold"]
    if allowed_s < 120:
        fail(f"the startup probe allows {allowed_s} s, too little to touch a large arena")
    ok(f"startupProbe allows {allowed_s} s for the arena's pre-touch")

    check_systemd_unit(kvtier)

    if os.geteuid() != 0:
        msg = "replaying the pod's start needs root (root-owned hostPath, switching uid)"
        if os.environ.get("KVTIER_DEPLOY_CHECK_NO_ROOT") == "skip":
            print(f"check_deploy: NOT RUN: {msg}")
            return
        fail(msg)
    replay_pod_start(kvtier, pod, toml_text)


if __name__ == "__main__":
    main()
