#!/usr/bin/python3
"""Offline check of the Kubernetes manifests in deploy/k8s (no cluster):
Debian's python3-yaml parses them and python3-jsonschema checks each
object against a schema of the fields these manifests use, written from
the Kubernetes API reference (core/v1, apps/v1, networking.k8s.io/v1).
The schemas are closed (additionalProperties: false) where the manifests
set fields, so a misspelt or misplaced field (readinesProbe, a probe under
the pod instead of the container, a secretGenerator in a kustomization)
fails, as kubectl's validation would. Quantities and ports are checked for
their formats.

Two variants are rendered here as `kubectl apply -k` would: deploy/k8s
itself (GPU hosts) and each overlay beside it, deploy/k8s-NAME (k8s-cpu:
its kustomization's resources plus its RFC 6902 JSON patches, applied by
this script; when kubectl is installed, `kubectl kustomize` must render
the same objects).
Then, for each variant, what a schema cannot see:
- deploy/k8s/kustomization.yaml lists every manifest but secret.yaml, and
  no variant applies a Secret (an apply -k would overwrite the real one
  with the template's placeholders);
- the StatefulSet's serviceName is a headless Service (clusterIP: None)
  whose selector, like the StatefulSet's selector and the NetworkPolicy's
  podSelector, matches the pod template's labels;
- GPU: the image is the CUDA image, args start with --device all, the
  container requests and limits nvidia.com/gpu (a positive integer, equal
  as the device plugin requires); CPU: the CPU image, no GPU request,
  limit or toleration, and args are the GPU variant's without --device all;
- terminationGracePeriodSeconds exceeds an explicit --drain-timeout by at
  least 10 s, so the kubelet never kills a drain that is on time;
- the pod runs as the image's non-root user (runAsNonRoot, runAsUser and
  fsGroup equal to the Containerfile's numeric USER, which
  Containerfile.cuda keeps), no privilege escalation, all capabilities
  dropped;
- the Secret volume mounts at /etc/dispatch, every key it projects exists
  in the Secret, and its mode gives nothing to others;
- every file the Containerfile's ENTRYPOINT, the args and the readiness
  probe read from /etc/dispatch is projected there;
- the readiness probe runs dispatch-probe (a TLS hello with the token),
  the liveness probe opens the server's port, and named ports resolve;
- the Service, the NetworkPolicy and the container use the port the
  ENTRYPOINT listens on;
- metrics: --metrics-listen 0.0.0.0:PORT with --metrics-public and a
  --metrics-token-file from the Secret, a container port "metrics" and a
  Service port for it; the NetworkPolicy admits exactly the two ports,
  clients (a podSelector) to the server's only, and to the metrics port
  one peer only, which names both a namespace and pods (the scraper);
  every rule names its peers and ports;
- peers (server-to-server transfers): --name is the pod's own name
  ($(VAR) of an env var from metadata.name), --peer lists every pod of
  the set, NAME-i=NAME-i.SERVICE:PORT for i below replicas, on the port
  the ENTRYPOINT listens on; --peer-ca and --peer-token-file are files of
  the Secret; the NetworkPolicy admits the set's own pods (its selector)
  to the listen port, and its egress goes only to them on that port and
  to the cluster DNS on port 53;
- each option in args is one `dispatch-server --help` lists (the binary in
  $DISPATCH_SERVER_BIN, when set);
- the Secret carries placeholders only: no PEM block, no key material.

Prints one line per check; exits 1 when any fails.
"""
import copy
import glob
import json
import os
import re
import shutil
import subprocess
import sys

import jsonschema
import yaml

QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$"
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


def obj(props, required=(), closed=True):
    s = {"type": "object", "properties": props, "required": list(required)}
    if closed:
        s["additionalProperties"] = False
    return s


STR = {"type": "string"}
INT = {"type": "integer"}
BOOL = {"type": "boolean"}
STRLIST = {"type": "array", "items": STR}
LABELS = {"type": "object", "additionalProperties": STR}
PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
INT_OR_NAME = {"oneOf": [PORT, {"type": "string", "pattern": DNS_LABEL, "maxLength": 15}]}
QTY = {"oneOf": [{"type": "string", "pattern": QUANTITY}, {"type": "integer", "minimum": 0}]}
METADATA = obj({"name": {"type": "string", "pattern": DNS_LABEL},
                "namespace": STR, "labels": LABELS, "annotations": LABELS},
               ["name"])
SELECTOR = obj({"matchLabels": LABELS}, ["matchLabels"])
PROTOCOL = {"enum": ["TCP", "UDP", "SCTP"]}

PROBE_TIMES = {"initialDelaySeconds": INT, "periodSeconds": INT,
               "timeoutSeconds": INT, "failureThreshold": INT,
               "successThreshold": INT}
PROBE = {"type": "object", "additionalProperties": False,
         "properties": dict(PROBE_TIMES,
                            exec=obj({"command": STRLIST}, ["command"]),
                            tcpSocket=obj({"port": INT_OR_NAME}, ["port"])),
         "oneOf": [{"required": ["exec"]}, {"required": ["tcpSocket"]}]}
CONTAINER = obj({
    "name": {"type": "string", "pattern": DNS_LABEL},
    "image": STR,
    "imagePullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
    "command": STRLIST,
    "args": STRLIST,
    "ports": {"type": "array", "items": obj({
        "name": {"type": "string", "pattern": DNS_LABEL, "maxLength": 15},
        "containerPort": PORT, "protocol": PROTOCOL}, ["containerPort"])},
    "resources": obj({"requests": {"type": "object", "additionalProperties": QTY},
                      "limits": {"type": "object", "additionalProperties": QTY}}),
    "securityContext": obj({
        "allowPrivilegeEscalation": BOOL, "readOnlyRootFilesystem": BOOL,
        "runAsNonRoot": BOOL, "runAsUser": INT, "runAsGroup": INT,
        "capabilities": obj({"drop": STRLIST, "add": STRLIST})}),
    "volumeMounts": {"type": "array", "items": obj({
        "name": STR, "mountPath": STR, "readOnly": BOOL, "subPath": STR},
        ["name", "mountPath"])},
    "readinessProbe": PROBE, "livenessProbe": PROBE, "startupProbe": PROBE,
    "env": {"type": "array", "items": obj({
        "name": STR, "value": STR,
        "valueFrom": obj({"fieldRef": obj({"fieldPath": STR, "apiVersion": STR},
                                          ["fieldPath"])}, ["fieldRef"])},
        ["name"])},
}, ["name", "image"])
POD_SPEC = obj({
    "automountServiceAccountToken": BOOL,
    "securityContext": obj({
        "runAsNonRoot": BOOL, "runAsUser": INT, "runAsGroup": INT,
        "fsGroup": INT,
        "seccompProfile": obj({"type": {"enum": ["RuntimeDefault", "Localhost", "Unconfined"]}},
                              ["type"])}),
    "tolerations": {"type": "array", "items": obj({
        "key": STR, "operator": {"enum": ["Exists", "Equal"]}, "value": STR,
        "effect": {"enum": ["NoSchedule", "PreferNoSchedule", "NoExecute"]}})},
    "nodeSelector": LABELS,
    "terminationGracePeriodSeconds": INT,
    "containers": {"type": "array", "minItems": 1, "items": CONTAINER},
    "volumes": {"type": "array", "items": obj({
        "name": STR,
        "secret": obj({"secretName": STR,
                       "defaultMode": {"type": "integer", "minimum": 0, "maximum": 0o777},
                       "items": {"type": "array", "items": obj(
                           {"key": STR, "path": STR, "mode": INT}, ["key", "path"])}},
                      ["secretName"])}, ["name"])},
}, ["containers"])

SCHEMAS = {
    ("kustomize.config.k8s.io/v1beta1", "Kustomization"): obj({
        "apiVersion": STR, "kind": STR, "resources": STRLIST,
        "namespace": STR,
        "patches": {"type": "array", "items": obj({
            "path": STR, "target": obj({"kind": STR, "name": STR}, ["kind", "name"])},
            ["path", "target"])}}, ["resources"]),
    ("v1", "Secret"): obj({
        "apiVersion": STR, "kind": STR, "metadata": METADATA,
        "type": STR, "stringData": LABELS, "data": LABELS}, ["metadata"]),
    ("v1", "Service"): obj({
        "apiVersion": STR, "kind": STR, "metadata": METADATA,
        "spec": obj({
            "clusterIP": STR, "selector": LABELS,
            "publishNotReadyAddresses": BOOL,
            "ports": {"type": "array", "minItems": 1, "items": obj({
                "name": STR, "port": PORT, "targetPort": INT_OR_NAME,
                "protocol": PROTOCOL}, ["port"])}}, ["ports"])},
        ["metadata", "spec"]),
    ("apps/v1", "StatefulSet"): obj({
        "apiVersion": STR, "kind": STR, "metadata": METADATA,
        "spec": obj({
            "serviceName": STR, "replicas": {"type": "integer", "minimum": 0},
            "podManagementPolicy": {"enum": ["OrderedReady", "Parallel"]},
            "selector": SELECTOR,
            "template": obj({"metadata": obj({"labels": LABELS, "annotations": LABELS}),
                             "spec": POD_SPEC}, ["spec"])},
            ["serviceName", "selector", "template"])},
        ["metadata", "spec"]),
    ("networking.k8s.io/v1", "NetworkPolicy"): obj({
        "apiVersion": STR, "kind": STR, "metadata": METADATA,
        "spec": obj({
            "podSelector": SELECTOR,
            "policyTypes": {"type": "array", "items": {"enum": ["Ingress", "Egress"]}},
            "ingress": {"type": "array", "items": obj({
                "from": {"type": "array", "items": obj({
                    "podSelector": SELECTOR, "namespaceSelector": SELECTOR})},
                "ports": {"type": "array", "items": obj({
                    "port": INT_OR_NAME, "protocol": PROTOCOL})}})},
            "egress": {"type": "array", "items": obj({
                "to": {"type": "array", "minItems": 1, "items": obj({
                    "podSelector": SELECTOR, "namespaceSelector": SELECTOR})},
                "ports": {"type": "array", "items": obj({
                    "port": INT_OR_NAME, "protocol": PROTOCOL})}}, ["to", "ports"])}},
            ["podSelector"])},
        ["metadata", "spec"]),
}

# an RFC 6902 patch as kustomize reads it from a patches: file
JSON_PATCH = {"type": "array", "minItems": 1, "items": obj({
    "op": {"enum": ["add", "remove", "replace"]},
    "path": {"type": "string", "pattern": "^(/[^/]*)+$"},
    "value": {}}, ["op", "path"])}

failures = 0


VARIANT = ""


def check(what, ok, detail=""):
    global failures
    print(("ok: k8s: " if ok else "FAILED: k8s: ") + VARIANT + what +
          ("" if ok or not detail else ": " + detail))
    if not ok:
        failures += 1


def containerfile(name="Containerfile"):
    """USER (uid, gid) and ENTRYPOINT argv of a Containerfile next to the
    manifests (the last USER: the one the image runs as)."""
    text = open(os.path.join(os.path.dirname(os.path.abspath(K8S)), name)).read()
    text = re.sub(r"\\\n", " ", text)
    users = re.findall(r"^USER\s+(\d+):(\d+)\s*$", text, re.M)
    user = users[-1] if users else None
    entry = re.search(r"^ENTRYPOINT\s+(\[.*\])\s*$", text, re.M)
    return (tuple(int(x) for x in user) if user else None,
            json.loads(entry.group(1)) if entry else [])


def validate(name, d):
    """Checks d against its kind's schema; returns the kind or None."""
    key = (d.get("apiVersion"), d.get("kind"))
    schema = SCHEMAS.get(key)
    if schema is None:
        check(name + ": known kind", False, "%s %s is not one this check knows" % key)
        return None
    errs = sorted(jsonschema.Draft7Validator(schema).iter_errors(d), key=lambda e: list(e.path))
    check("%s: %s matches the schema" % (name, key[1]), not errs,
          "; ".join("%s: %s" % ("/".join(map(str, e.path)) or "(top)", e.message) for e in errs))
    return key[1]


def load(path):
    """The documents of one YAML file ([] when it does not parse)."""
    try:
        return [d for d in yaml.safe_load_all(open(path)) if d is not None]
    except (OSError, yaml.YAMLError) as e:
        check(os.path.relpath(path, K8S) + " parses as YAML", False, str(e))
        return []


def apply_patch(doc, ops):
    """RFC 6902 add/remove/replace on doc, in place; KeyError/IndexError
    when a path to remove or replace is not there."""
    for op in ops:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        parent = doc
        for p in parts[:-1]:
            parent = parent[int(p)] if isinstance(parent, list) else parent[p]
        last = parts[-1]
        if isinstance(parent, list):
            i = len(parent) if last == "-" else int(last)
            if op["op"] != "add" and not 0 <= i < len(parent):
                raise IndexError(op["path"])
            if op["op"] == "remove":
                del parent[i]
            elif op["op"] == "replace":
                parent[i] = op["value"]
            else:
                parent.insert(i, op["value"])
        else:
            if op["op"] != "add" and last not in parent:
                raise KeyError(op["path"])
            if op["op"] == "remove":
                del parent[last]
            else:
                parent[last] = op["value"]


def render(d):
    """The objects `kubectl apply -k d` would apply (resources, nested
    kustomizations, JSON patches), each checked against its schema."""
    rel = os.path.relpath(d, os.path.dirname(os.path.normpath(K8S)))
    kusts = load(os.path.join(d, "kustomization.yaml"))
    if len(kusts) != 1 or validate(os.path.join(rel, "kustomization.yaml"), kusts[0]) is None:
        return []
    kust = kusts[0]
    objs = []
    for r in kust["resources"]:
        p = os.path.normpath(os.path.join(d, r))
        if os.path.isdir(p):
            objs += render(p)
        else:
            objs += [copy.deepcopy(o) for o in load(p)]
    for pt in kust.get("patches", []):
        ops = load(os.path.join(d, pt["path"]))
        ops = ops[0] if len(ops) == 1 else None
        errs = list(jsonschema.Draft7Validator(JSON_PATCH).iter_errors(ops))
        check("%s: %s is a JSON patch" % (rel, pt["path"]), not errs, "; ".join(e.message for e in errs))
        targets = [o for o in objs if o.get("kind") == pt["target"]["kind"]
                   and o.get("metadata", {}).get("name") == pt["target"]["name"]]
        check("%s: %s has one target" % (rel, pt["path"]), len(targets) == 1, "found %d" % len(targets))
        if errs or len(targets) != 1:
            continue
        try:
            apply_patch(targets[0], ops)
            check("%s: %s applies" % (rel, pt["path"]), True)
        except (KeyError, IndexError, ValueError, TypeError) as e:
            check("%s: %s applies" % (rel, pt["path"]), False, "no %s" % e)
    if os.path.normpath(d) != os.path.normpath(K8S):
        for o in objs:
            validate("%s (rendered) %s" % (rel, o.get("metadata", {}).get("name")), o)
    return objs


def kubectl_agrees(d, objs):
    """When kubectl is installed, its own kustomize must render objs."""
    if not shutil.which("kubectl"):
        print("note: k8s: %skubectl not installed: rendering not compared with kubectl kustomize" % VARIANT)
        return
    r = subprocess.run(["kubectl", "kustomize", d], capture_output=True, text=True)
    theirs = list(yaml.safe_load_all(r.stdout)) if r.returncode == 0 else []

    def key(o):
        return json.dumps(o, sort_keys=True)
    check("kubectl kustomize %s renders the same objects" % os.path.relpath(d),
          r.returncode == 0 and sorted(map(key, theirs)) == sorted(map(key, objs)),
          r.stderr.strip() or "they differ")


def opt(args, name):
    """The value after option name in args (None when absent)."""
    return args[args.index(name) + 1] if name in args[:-1] else None


def variant_checks(objs, secret, uidgid, entry, gpu):
    """Everything a variant's objects must satisfy; returns its container."""
    kinds = {}
    for o in objs:
        kinds.setdefault(o.get("kind"), []).append(o)
    check("applies no Secret (the real one is made apart and never overwritten)",
          "Secret" not in kinds, "applies %s" % [o["metadata"]["name"] for o in kinds.get("Secret", [])])

    def one(kind):
        got = kinds.get(kind, [])
        check("exactly one " + kind, len(got) == 1, "found %d" % len(got))
        return got[0] if got else None

    svc, sts, netpol = (one(k) for k in ("Service", "StatefulSet", "NetworkPolicy"))
    if not all((svc, sts, netpol)):
        return None
    pod = sts["spec"]["template"]
    labels = pod.get("metadata", {}).get("labels", {})
    spec = pod["spec"]
    c = spec["containers"][0]
    args = c.get("args", [])

    def matches(sel):
        return bool(sel) and all(labels.get(k) == v for k, v in sel.items())

    check("StatefulSet selector matches the pod labels", matches(sts["spec"]["selector"]["matchLabels"]))
    check("StatefulSet serviceName is the Service", sts["spec"]["serviceName"] == svc["metadata"]["name"])
    check("Service is headless (clusterIP: None)", svc["spec"].get("clusterIP") == "None")
    check("Service selector matches the pod labels", matches(svc["spec"].get("selector")))
    check("NetworkPolicy podSelector matches the pod labels", matches(netpol["spec"]["podSelector"]["matchLabels"]))

    res = c.get("resources", {})
    gl, gr = res.get("limits", {}).get("nvidia.com/gpu"), res.get("requests", {}).get("nvidia.com/gpu")
    tolerates_gpu = any(t.get("key") == "nvidia.com/gpu" for t in spec.get("tolerations", []))
    image = c["image"].rsplit(":", 1)[0]
    if gpu:
        check("container limits nvidia.com/gpu to a positive integer", isinstance(gl, int) and gl > 0, repr(gl))
        check("nvidia.com/gpu requests equal limits", gr is None or gr == gl, "%r vs %r" % (gr, gl))
        check("image is the CUDA image (…/dispatch-server-cuda)", image.endswith("/dispatch-server-cuda"), image)
        check("args start with --device all", args[:2] == ["--device", "all"], repr(args[:2]))
    else:
        check("requests and limits no GPU", gl is None and gr is None, "%r %r" % (gr, gl))
        check("no GPU toleration", not tolerates_gpu)
        check("image is the CPU image (…/dispatch-server)", image.endswith("/dispatch-server"), image)
        check("no --device all", "--device" not in args, repr(args))

    drain = opt(args, "--drain-timeout")
    grace = spec.get("terminationGracePeriodSeconds")
    check("--drain-timeout is set explicitly", bool(drain) and drain.isdigit(), repr(drain))
    if drain and drain.isdigit():
        check("terminationGracePeriodSeconds %r is --drain-timeout %s plus at least 10 s" % (grace, drain),
              isinstance(grace, int) and grace >= int(drain) + 10)

    psc, csc = spec.get("securityContext", {}), c.get("securityContext", {})
    check("pod runAsNonRoot", psc.get("runAsNonRoot") is True)
    if uidgid:
        check("pod runAsUser/runAsGroup/fsGroup are the image's USER %d:%d" % uidgid,
              (psc.get("runAsUser"), psc.get("runAsGroup")) == uidgid and psc.get("fsGroup") == uidgid[1],
              "%r" % psc)
    check("container: no privilege escalation, capabilities dropped",
          csc.get("allowPrivilegeEscalation") is False and "ALL" in csc.get("capabilities", {}).get("drop", []))

    mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
    m = mounts.get("/etc/dispatch")
    check("a volume is mounted read-only at /etc/dispatch", bool(m) and m.get("readOnly") is True)
    vol = next((v for v in spec.get("volumes", []) if m and v["name"] == m["name"]), None)
    sec = vol.get("secret") if vol else None
    check("/etc/dispatch is the Secret", bool(sec) and sec["secretName"] == secret["metadata"]["name"])
    if not sec:
        return c
    keys = set(secret.get("stringData", {})) | set(secret.get("data", {}))
    items = sec.get("items") or [{"key": k, "path": k} for k in keys]
    missing = [i["key"] for i in items if i["key"] not in keys]
    check("every projected key exists in the Secret", not missing, "missing %s" % missing)
    modes = [sec.get("defaultMode", 0o644)] + [i["mode"] for i in items if "mode" in i]
    check("Secret files give nothing to others (mode & 007 == 0)", all(md & 0o007 == 0 for md in modes),
          " ".join(oct(md) for md in modes))
    projected = {"/etc/dispatch/" + i["path"] for i in items}

    rp, lp = c.get("readinessProbe", {}), c.get("livenessProbe", {})
    rcmd = rp.get("exec", {}).get("command", [])
    check("readiness probe runs dispatch-probe", bool(rcmd) and rcmd[0].endswith("/dispatch-probe"), repr(rcmd))
    check("liveness probe opens the server's port", "tcpSocket" in lp or "exec" in lp)
    needed = {a for a in entry + args + rcmd if a.startswith("/etc/dispatch/")}
    check("every file the ENTRYPOINT, the args and the probe read is in the Secret volume",
          needed <= projected, "missing %s" % sorted(needed - projected))

    listen = entry[entry.index("--listen") + 1] if "--listen" in entry else ""
    lport = int(listen.rsplit(":", 1)[1]) if ":" in listen else None
    cports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
    check("container port is the ENTRYPOINT's --listen port %s" % lport, lport in cports.values(), repr(cports))

    def resolve(p):
        return cports.get(p) if isinstance(p, str) else p

    check("liveness port resolves to the listen port",
          "tcpSocket" not in lp or resolve(lp["tcpSocket"]["port"]) == lport)
    check("readiness probe connects to the listen port",
          any(a.endswith(":%s" % lport) for a in rcmd))
    sports = [resolve(p.get("targetPort", p["port"])) for p in svc["spec"]["ports"]]
    check("Service targets the listen port", lport in sports, repr(sports))

    # metrics: beyond loopback (explicitly), with a token, on its own port
    ml = opt(args, "--metrics-listen") or ""
    mport = int(ml.rsplit(":", 1)[1]) if re.match(r"^0\.0\.0\.0:\d+$", ml) else None
    check("--metrics-listen 0.0.0.0:PORT with --metrics-public", bool(mport) and "--metrics-public" in args,
          repr(ml))
    check("--metrics-token-file is a file of the Secret volume",
          opt(args, "--metrics-token-file") in projected, repr(opt(args, "--metrics-token-file")))
    check("container port \"metrics\" is the --metrics-listen port %s, not the server's" % mport,
          cports.get("metrics") == mport and mport != lport, repr(cports))
    check("Service lists the metrics port (service discovery)", mport in sports, repr(sports))

    rules = netpol["spec"].get("ingress", [])

    def rule_ports(r):
        return {resolve(p.get("port")) for p in r.get("ports", [])}

    check("every NetworkPolicy ingress rule names its peers and its ports (none admits everyone)",
          all(r.get("from") and r.get("ports") and all(r["from"]) and None not in rule_ports(r)
              for r in rules))
    allp = set().union(*map(rule_ports, rules)) if rules else set()
    check("NetworkPolicy admits the listen port and the metrics port, nothing else",
          allp == {lport, mport}, repr(sorted(allp, key=str)))
    lrules = [r for r in rules if lport in rule_ports(r)]
    check("clients and peers reach the listen port only, each rule choosing pods by label",
          len(lrules) >= 1 and all(rule_ports(r) == {lport} and
                                   all(set(peer) == {"podSelector"} for peer in r.get("from", []))
                                   for r in lrules))
    own = sts["spec"]["selector"]["matchLabels"]
    check("peers: an ingress rule admits the set's own pods (its selector) to the listen port",
          any(peer.get("podSelector", {}).get("matchLabels") == own for r in lrules for peer in r["from"]))
    check("clients (pods labelled dispatch-client) reach the listen port",
          any(peer.get("podSelector", {}).get("matchLabels") == {"dispatch-client": "true"}
              for r in lrules for peer in r["from"]))
    mrules = [r for r in rules if mport in rule_ports(r)]
    peers = mrules[0].get("from", []) if len(mrules) == 1 else []
    check("only the scraper reaches the metrics port: one peer naming a namespace and pods",
          len(mrules) == 1 and rule_ports(mrules[0]) == {mport} and len(peers) == 1
          and all(peers[0].get(k, {}).get("matchLabels") for k in ("namespaceSelector", "podSelector")),
          repr(mrules))
    egress = netpol["spec"].get("egress") or []

    def egress_ok(r):
        ports = {resolve(p.get("port")) for p in r.get("ports", [])}
        to_own = [set(t) == {"podSelector"} and t["podSelector"]["matchLabels"] == own for t in r["to"]]
        to_dns = [t.get("namespaceSelector", {}).get("matchLabels") ==
                  {"kubernetes.io/metadata.name": "kube-system"} and
                  t.get("podSelector", {}).get("matchLabels") == {"k8s-app": "kube-dns"} for t in r["to"]]
        return (all(to_own) and ports == {lport}) or (all(to_dns) and ports == {53})
    check("egress only to the set's own pods on the listen port and to the cluster DNS on 53",
          "Egress" in netpol["spec"].get("policyTypes", []) and all(map(egress_ok, egress))
          and any(egress_ok(r) and lport in {resolve(p.get("port")) for p in r["ports"]} for r in egress),
          repr(egress))

    # peers: the pod's own name, every sibling by its DNS name and port
    name = opt(args, "--name") or ""
    ref = re.match(r"^\$\((\w+)\)$", name)
    env = {e["name"]: e for e in c.get("env", [])}
    field = env.get(ref.group(1), {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") if ref else None
    check("--name is the pod's name ($(VAR), VAR from metadata.name)", field == "metadata.name",
          "--name %r, env %r" % (name, env))
    sname, n = sts["metadata"]["name"], sts["spec"].get("replicas", 1)
    want = ["%s-%d=%s-%d.%s:%s" % (sname, i, sname, i, svc["metadata"]["name"], lport) for i in range(n)]
    got = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--peer"]
    check("--peer lists every pod of the set (replicas %d) at its stable name on the listen port" % n,
          sorted(got) == sorted(want), "%r vs %r" % (got, want))
    check("--peer-ca and --peer-token-file are files of the Secret volume",
          opt(args, "--peer-ca") in projected and opt(args, "--peer-token-file") in projected,
          "%r %r" % (opt(args, "--peer-ca"), opt(args, "--peer-token-file")))

    server = os.environ.get("DISPATCH_SERVER_BIN")
    if server:
        helptext = subprocess.run([server, "--help"], capture_output=True, text=True).stdout
        known = set(re.findall(r"^\s+(--[a-z-]+)", helptext, re.M))
        opts = [a.split("=")[0] for a in entry[1:] + args if a.startswith("--")]
        unknown = [o for o in opts if o not in known]
        check("every option of ENTRYPOINT and args is one dispatch-server --help lists",
              bool(known) and not unknown, "unknown %s" % unknown)
    return c


def main():
    global VARIANT
    docs = {}
    files = sorted(glob.glob(os.path.join(K8S, "*.yaml")))
    check("manifests found in " + K8S, len(files) > 0)
    for path in files:
        name = os.path.basename(path)
        for d in load(path):
            kind = validate(name, d)
            if kind:
                docs.setdefault(kind, []).append((name, d))
    secrets = docs.get("Secret", [])
    check("one Secret template (secret.yaml)", [n for n, _ in secrets] == ["secret.yaml"],
          repr([n for n, _ in secrets]))
    if len(secrets) != 1:
        return
    secret = secrets[0][1]
    text = open(os.path.join(K8S, "secret.yaml")).read()
    check("Secret holds placeholders, no key or certificate", "-----BEGIN" not in text)
    kust = [d for n, d in docs.get("Kustomization", [])]
    others = sorted(os.path.basename(f) for f in files
                    if os.path.basename(f) not in ("kustomization.yaml", "secret.yaml"))
    check("kustomization.yaml lists every manifest but secret.yaml",
          len(kust) == 1 and sorted(kust[0]["resources"]) == others,
          "lists %s, have %s" % (kust[0]["resources"] if kust else None, others))

    uidgid, entry = containerfile()
    check("Containerfile has a numeric USER uid:gid", uidgid is not None)
    check("Containerfile has an ENTRYPOINT", bool(entry))
    check("Containerfile.cuda runs as the same USER", containerfile("Containerfile.cuda")[0] == uidgid)

    # overlays beside the base (kustomize refuses one inside it: a cycle)
    overlays = sorted(glob.glob(os.path.normpath(K8S) + "-*/kustomization.yaml"))
    variants = [("gpu", K8S)] + [(os.path.dirname(k).rsplit("-", 1)[1], os.path.dirname(k))
                                 for k in overlays]
    check("a CPU overlay (%s-cpu/kustomization.yaml)" % os.path.normpath(K8S), "cpu" in dict(variants))
    containers = {}
    for name, d in variants:
        VARIANT = "(%s) " % name
        objs = render(d)
        kubectl_agrees(d, objs)
        containers[name] = variant_checks(objs, secret, uidgid, entry, gpu=(name == "gpu"))
    VARIANT = ""
    g, c = containers.get("gpu"), containers.get("cpu")
    if g and c:
        check("the CPU variant's args are the GPU variant's without --device all",
              g.get("args", [])[2:] == c.get("args", []), "%r vs %r" % (g.get("args"), c.get("args")))


if __name__ == "__main__":  # check_group.py imports the schema pieces
    K8S = sys.argv[1] if len(sys.argv) > 1 else "deploy/k8s"
    main()
    sys.exit(1 if failures else 0)
