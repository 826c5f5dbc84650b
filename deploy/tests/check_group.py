#!/usr/bin/python3
"""Offline check of deploy/group (no cluster): the MPIJob of the Kubeflow
MPI operator and the NetworkPolicy of a dispatch-server group. Debian's
python3-yaml parses them and python3-jsonschema checks each object
against a closed schema of the fields they use (kubeflow.org/v2beta1
MPIJob, networking.k8s.io/v1 NetworkPolicy, the kustomization), so a
misspelt or misplaced field fails. Then what a schema cannot see:
- the kustomization lists every manifest of the folder;
- the NetworkPolicy selects the pods of every replica (launcher, workers);
  the only rule without ports admits the group's own pods and nothing
  else; the clients' rule admits exactly the ranks' ports (BASE .. BASE +
  np - 1); egress goes only to the group's pods or to DNS (port 53);
- the launcher runs mpirun with one app context per rank (-np 1 each,
  separated by ":"; as many as workers x slotsPerWorker), each starting
  the same dispatch-server command line but for --name: --mpi
  --mpi-insecure (ranks on separate pods are not on loopback: without the
  flag they refuse to start) with --listen 0.0.0.0:BASE, TLS and a token
  for the clients;
- peers: each rank has its own --name, and every rank lists every rank
  with --peer at its worker's stable DNS name (JOB-worker-R.JOB-worker)
  and its port BASE + R, with --peer-ca and --peer-token-file;
- every /etc/dispatch file the ranks read is a key of the Secret they
  mount (deploy/k8s/secret.yaml, the template of that Secret);
- each worker declares the ranks' ports, and the grace period exceeds an
  explicit --drain-timeout by at least 10 s;
- the job restarts as a whole: the launcher's restartPolicy is OnFailure
  and runPolicy.backoffLimit is at least 1;
- the Secret's mode gives nothing to others;
- each option after dispatch-server is one `dispatch-server --help` lists
  (the binary in $DISPATCH_SERVER_BIN, when set).
Prints one line per check ("ok: group: ..." / "FAILED: group: ...");
exits 1 when any fails."""
import glob
import os
import re
import subprocess
import sys

import jsonschema
import yaml

failures = 0


def check(what, ok, detail=""):
    global failures
    print(("ok: group: " if ok else "FAILED: group: ") + what +
          ("" if ok or not detail else ": " + detail))
    if not ok:
        failures += 1


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_k8s import (BOOL, DNS_LABEL, INT, LABELS, METADATA, PORT,  # noqa: E402
                       PROTOCOL, SELECTOR, STR, STRLIST, obj)


CONTAINER = obj({
    "name": {"type": "string", "pattern": DNS_LABEL},
    "image": STR, "command": STRLIST, "args": STRLIST,
    "ports": {"type": "array", "items": obj({
        "name": {"type": "string", "pattern": DNS_LABEL, "maxLength": 15},
        "containerPort": PORT, "protocol": PROTOCOL}, ["containerPort"])},
    "volumeMounts": {"type": "array", "items": obj({
        "name": STR, "mountPath": STR, "readOnly": BOOL}, ["name", "mountPath"])},
}, ["name", "image"])
POD = obj({
    "metadata": obj({"labels": LABELS}),
    "spec": obj({
        "terminationGracePeriodSeconds": INT,
        "containers": {"type": "array", "minItems": 1, "items": CONTAINER},
        "volumes": {"type": "array", "items": obj({
            "name": STR,
            "secret": obj({"secretName": STR, "defaultMode": INT}, ["secretName"])},
            ["name"])},
    }, ["containers"]),
}, ["metadata", "spec"])
REPLICA = obj({"replicas": {"type": "integer", "minimum": 1},
               "restartPolicy": {"enum": ["Always", "OnFailure", "Never", "ExitCode"]},
               "template": POD}, ["replicas", "template"])
MPIJOB = obj({
    "apiVersion": {"const": "kubeflow.org/v2beta1"}, "kind": {"const": "MPIJob"},
    "metadata": METADATA,
    "spec": obj({
        "slotsPerWorker": {"type": "integer", "minimum": 1},
        "mpiImplementation": {"enum": ["OpenMPI", "Intel", "MPICH"]},
        "runPolicy": obj({"cleanPodPolicy": {"enum": ["None", "Running", "All"]},
                          "backoffLimit": INT}),
        "mpiReplicaSpecs": obj({"Launcher": REPLICA, "Worker": REPLICA},
                               ["Launcher", "Worker"]),
    }, ["mpiReplicaSpecs"]),
}, ["apiVersion", "kind", "metadata", "spec"])
PEER = obj({"podSelector": SELECTOR, "namespaceSelector": SELECTOR})
NPPORTS = {"type": "array", "items": obj({"port": PORT, "protocol": PROTOCOL}, ["port"])}
NETPOL = obj({
    "apiVersion": {"const": "networking.k8s.io/v1"}, "kind": {"const": "NetworkPolicy"},
    "metadata": METADATA,
    "spec": obj({
        "podSelector": SELECTOR,
        "policyTypes": {"type": "array", "items": {"enum": ["Ingress", "Egress"]}},
        "ingress": {"type": "array", "items": obj({"from": {"type": "array", "minItems": 1, "items": PEER},
                                                   "ports": NPPORTS}, ["from"])},
        "egress": {"type": "array", "items": obj({"to": {"type": "array", "minItems": 1, "items": PEER},
                                                  "ports": NPPORTS}, ["to"])},
    }, ["podSelector", "policyTypes", "ingress", "egress"]),
}, ["apiVersion", "kind", "metadata", "spec"])
KUST = obj({"apiVersion": {"const": "kustomize.config.k8s.io/v1beta1"},
            "kind": {"const": "Kustomization"}, "resources": STRLIST},
           ["apiVersion", "kind", "resources"])
SCHEMAS = {"MPIJob": MPIJOB, "NetworkPolicy": NETPOL, "Kustomization": KUST}


def validate(name, d):
    schema = SCHEMAS.get(d.get("kind"))
    if schema is None:
        check(name + ": known kind", False, str(d.get("kind")))
        return
    errs = list(jsonschema.Draft7Validator(schema).iter_errors(d))
    check("%s: %s matches the schema" % (name, d["kind"]), not errs,
          "; ".join("%s: %s" % ("/".join(map(str, e.path)) or "(top)", e.message) for e in errs))


def opt(args, name):
    return args[args.index(name) + 1] if name in args and args.index(name) + 1 < len(args) else None


def main():
    d = sys.argv[1] if len(sys.argv) > 1 else "deploy/group"
    objs = {}
    files = sorted(glob.glob(os.path.join(d, "*.yaml")))
    for f in files:
        try:
            docs = [x for x in yaml.safe_load_all(open(f)) if x is not None]
        except (OSError, yaml.YAMLError) as e:
            check(os.path.basename(f) + " parses as YAML", False, str(e))
            continue
        for x in docs:
            validate(os.path.basename(f), x)
            objs.setdefault(x.get("kind"), x)
    kust, job, pol = objs.get("Kustomization"), objs.get("MPIJob"), objs.get("NetworkPolicy")
    check("an MPIJob, a NetworkPolicy and a kustomization", bool(kust and job and pol))
    if not (kust and job and pol):
        return 1
    want = sorted(os.path.basename(f) for f in files if os.path.basename(f) != "kustomization.yaml")
    check("the kustomization lists every manifest", sorted(kust["resources"]) == want,
          "%s vs %s" % (kust["resources"], want))

    spec = job["spec"]
    reps = spec["mpiReplicaSpecs"]
    la, wo = reps["Launcher"], reps["Worker"]
    sel = pol["spec"]["podSelector"]["matchLabels"]

    def selects(labels):
        return all(labels.get(k) == v for k, v in sel.items())

    check("the NetworkPolicy selects the launcher's and the workers' pods",
          selects(la["template"]["metadata"]["labels"]) and selects(wo["template"]["metadata"]["labels"]))
    args = la["template"]["spec"]["containers"][0].get("args", [])
    cmd = la["template"]["spec"]["containers"][0].get("command", [])
    n = wo["replicas"] * spec.get("slotsPerWorker", 1)
    contexts, cur = [], []
    for a in args:
        if a == ":":
            contexts.append(cur)
            cur = []
        else:
            cur.append(a)
    contexts.append(cur)
    nps = [opt(c, "-np") for c in contexts]
    check("the launcher runs mpirun with one app context of -np 1 per rank (%d)" % n,
          cmd[:1] == ["mpirun"] and nps == ["1"] * n, "command %s, -np %s" % (cmd, nps))
    srvs = [c[c.index("dispatch-server") + 1:] if "dispatch-server" in c else [] for c in contexts]
    srv = srvs[0]

    def but_name(a):
        return [x for i, x in enumerate(a) if x != "--name" and (i == 0 or a[i - 1] != "--name")]
    check("every rank runs the same dispatch-server command line but for --name",
          all(srvs) and all(but_name(x) == but_name(srv) for x in srvs))
    check("mpirun starts dispatch-server --mpi --mpi-insecure",
          "--mpi" in srv and "--mpi-insecure" in srv, " ".join(srv))
    listen = opt(srv, "--listen") or ""
    m = re.match(r"^0\.0\.0\.0:(\d+)$", listen)
    base = int(m.group(1)) if m else None
    check("--listen 0.0.0.0:BASE", base is not None, listen)
    check("the clients' side keeps TLS and a token",
          all(opt(srv, o) for o in ("--tls-cert", "--tls-key", "--token-file")))
    ranks = set(range(base, base + n)) if base is not None else set()
    wports = {p["containerPort"] for p in wo["template"]["spec"]["containers"][0].get("ports", [])}
    check("each worker declares the ranks' ports %s" % sorted(ranks), wports == ranks, str(sorted(wports)))

    # peers: every rank by its worker's stable name and its own port
    names = [opt(x, "--name") for x in srvs]
    check("each rank has its own --name", all(names) and len(set(names)) == len(names), str(names))
    job_name = job["metadata"]["name"]
    want = sorted("%s=%s-worker-%d.%s-worker:%d" % (names[r], job_name, r, job_name, base + r)
                  for r in range(min(n, len(names)))) if base is not None and all(names) else None
    got = sorted(srv[i + 1] for i, a in enumerate(srv[:-1]) if a == "--peer")
    check("--peer lists every rank at its worker's stable name and its port (BASE + r)",
          want is not None and got == want, "%s vs %s" % (got, want))
    check("the ranks present --peer-ca and --peer-token-file to their peers",
          bool(opt(srv, "--peer-ca")) and bool(opt(srv, "--peer-token-file")))
    vols = wo["template"]["spec"].get("volumes", [])
    mounts = wo["template"]["spec"]["containers"][0].get("volumeMounts", [])
    mount = next((m for m in mounts if m["mountPath"] == "/etc/dispatch"), None)
    vol = next((v for v in vols if mount and v["name"] == mount["name"] and "secret" in v), None)
    tmpl = os.path.join(d, "..", "k8s", "secret.yaml")
    secret = yaml.safe_load(open(tmpl)) if os.path.exists(tmpl) else {}
    keys = set(secret.get("stringData", {})) | set(secret.get("data", {}))
    same = vol is not None and vol["secret"]["secretName"] == secret.get("metadata", {}).get("name")
    files = sorted({a[len("/etc/dispatch/"):] for x in srvs for a in x if a.startswith("/etc/dispatch/")})
    check("every /etc/dispatch file the ranks read is a key of the Secret the workers mount there",
          same and set(files) <= keys, "files %s, %s keys %s" % (files, tmpl, sorted(keys)))

    rules = pol["spec"]["ingress"]
    open_rules = [r for r in rules if not r.get("ports")]
    check("the only ingress rule without ports admits the group's pods alone",
          all(len(r["from"]) == 1 and set(r["from"][0]) == {"podSelector"} and
              r["from"][0]["podSelector"]["matchLabels"] == sel for r in open_rules) and len(open_rules) == 1)
    client_ports = {p["port"] for r in rules if r.get("ports") for p in r["ports"]}
    check("the clients' rule admits exactly the ranks' ports", client_ports == ranks,
          "%s vs %s" % (sorted(client_ports), sorted(ranks)))
    ok_egress = True
    for r in pol["spec"]["egress"]:
        to_group = len(r["to"]) == 1 and set(r["to"][0]) == {"podSelector"} and \
            r["to"][0]["podSelector"]["matchLabels"] == sel and not r.get("ports")
        dns = r.get("ports") and all(p["port"] == 53 for p in r["ports"])
        ok_egress = ok_egress and bool(to_group or dns)
    check("egress only to the group's pods and to DNS", ok_egress and
          set(pol["spec"]["policyTypes"]) == {"Ingress", "Egress"})

    check("the job restarts as a whole (launcher OnFailure, backoffLimit >= 1)",
          la.get("restartPolicy") == "OnFailure" and spec.get("runPolicy", {}).get("backoffLimit", 0) >= 1)
    drain = opt(srv, "--drain-timeout")
    grace = wo["template"]["spec"].get("terminationGracePeriodSeconds", 30)
    check("grace period >= --drain-timeout + 10", drain is None or grace >= int(drain) + 10,
          "%s vs %s" % (grace, drain))
    modes = [v["secret"].get("defaultMode", 0o644) for v in wo["template"]["spec"].get("volumes", []) if "secret" in v]
    check("the Secret gives nothing to others", all(mo & 0o007 == 0 for mo in modes), str(modes))
    binp = os.environ.get("DISPATCH_SERVER_BIN")
    if binp:
        help_ = subprocess.run([binp, "--help"], capture_output=True, text=True).stdout
        known = set(re.findall(r"(--[a-z][-a-z]*)", help_))
        unknown = sorted({a for x in srvs for a in x if a.startswith("--") and a not in known})
        check("every dispatch-server option is one --help lists", not unknown, " ".join(unknown))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
