#!/usr/bin/python3
"""Offline check of the Kubernetes manifests in deploy/k8s (no cluster, no
kubectl): Debian's python3-yaml parses them and python3-jsonschema checks
each object against a schema of the fields these manifests use, written
from the Kubernetes API reference (core/v1, apps/v1, networking.k8s.io/v1).
The schemas are closed (additionalProperties: false) where the manifests
set fields, so a misspelt or misplaced field (readinesProbe, a probe under
the pod instead of the container) fails, as kubectl's validation would.
Quantities and ports are checked for their formats.

Then what a schema cannot see:
- kustomization.yaml lists every manifest and nothing else;
- the StatefulSet's serviceName is a headless Service (clusterIP: None)
  whose selector, like the StatefulSet's selector and the NetworkPolicy's
  podSelector, matches the pod template's labels;
- the container requests and limits nvidia.com/gpu (a positive integer,
  requests equal to limits as the device plugin requires);
- the pod runs as the image's non-root user (runAsNonRoot, runAsUser and
  fsGroup equal to the Containerfile's numeric USER), no privilege
  escalation, all capabilities dropped;
- the Secret volume mounts at /etc/dispatch, every key it projects exists
  in the Secret, and its mode gives nothing to others;
- every file the Containerfile's ENTRYPOINT and the readiness probe read
  from /etc/dispatch is projected there;
- the readiness probe runs dispatch-probe (a TLS hello with the token),
  the liveness probe opens the server's port, and named ports resolve;
- the Service, the NetworkPolicy and the container use the port the
  ENTRYPOINT listens on;
- each option in args is one `dispatch-server --help` lists (the binary in
  $DISPATCH_SERVER_BIN, when set);
- the Secret carries placeholders only: no PEM block, no key material.

Prints one line per check; exits 1 when any fails.
"""
import glob
import json
import os
import re
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
    "env": {"type": "array"},
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
        "namespace": STR}, ["resources"]),
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
            "egress": {"type": "array"}}, ["podSelector"])},
        ["metadata", "spec"]),
}

failures = 0


def check(what, ok, detail=""):
    global failures
    print(("ok: k8s: " if ok else "FAILED: k8s: ") + what + ("" if ok or not detail else ": " + detail))
    if not ok:
        failures += 1


def containerfile():
    """USER (uid, gid), ENTRYPOINT argv and the probe's argv of the
    Containerfile next to the manifests."""
    text = open(os.path.join(os.path.dirname(os.path.abspath(K8S)), "Containerfile")).read()
    text = re.sub(r"\\\n", " ", text)
    user = re.search(r"^USER\s+(\d+):(\d+)\s*$", text, re.M)
    entry = re.search(r"^ENTRYPOINT\s+(\[.*\])\s*$", text, re.M)
    return (tuple(int(x) for x in user.groups()) if user else None,
            json.loads(entry.group(1)) if entry else [])


def main():
    docs = {}
    files = sorted(glob.glob(os.path.join(K8S, "*.yaml")))
    check("manifests found in " + K8S, len(files) > 0)
    for path in files:
        name = os.path.basename(path)
        try:
            loaded = [d for d in yaml.safe_load_all(open(path)) if d is not None]
        except yaml.YAMLError as e:
            check(name + " parses as YAML", False, str(e))
            continue
        for d in loaded:
            key = (d.get("apiVersion"), d.get("kind"))
            schema = SCHEMAS.get(key)
            if schema is None:
                check(name + ": known kind", False, "%s %s is not one this check knows" % key)
                continue
            errs = sorted(jsonschema.Draft7Validator(schema).iter_errors(d), key=lambda e: list(e.path))
            check("%s: %s matches the schema" % (name, key[1]), not errs,
                  "; ".join("%s: %s" % ("/".join(map(str, e.path)) or "(top)", e.message) for e in errs))
            docs.setdefault(key[1], []).append((name, d))

    def one(kind):
        got = docs.get(kind, [])
        check("exactly one " + kind, len(got) == 1, "found %d" % len(got))
        return got[0][1] if got else None

    kust, secret, svc, sts, netpol = (one(k) for k in
                                      ("Kustomization", "Secret", "Service", "StatefulSet", "NetworkPolicy"))
    if not all((kust, secret, svc, sts, netpol)):
        return
    others = sorted(os.path.basename(f) for f in files if os.path.basename(f) != "kustomization.yaml")
    check("kustomization.yaml lists every manifest", sorted(kust["resources"]) == others,
          "lists %s, have %s" % (kust["resources"], others))

    uidgid, entry = containerfile()
    check("Containerfile has a numeric USER uid:gid", uidgid is not None)
    check("Containerfile has an ENTRYPOINT", bool(entry))
    pod = sts["spec"]["template"]
    labels = pod.get("metadata", {}).get("labels", {})
    spec = pod["spec"]
    c = spec["containers"][0]

    def matches(sel):
        return bool(sel) and all(labels.get(k) == v for k, v in sel.items())

    check("StatefulSet selector matches the pod labels", matches(sts["spec"]["selector"]["matchLabels"]))
    check("StatefulSet serviceName is the Service", sts["spec"]["serviceName"] == svc["metadata"]["name"])
    check("Service is headless (clusterIP: None)", svc["spec"].get("clusterIP") == "None")
    check("Service selector matches the pod labels", matches(svc["spec"].get("selector")))
    check("NetworkPolicy podSelector matches the pod labels", matches(netpol["spec"]["podSelector"]["matchLabels"]))

    res = c.get("resources", {})
    gl, gr = res.get("limits", {}).get("nvidia.com/gpu"), res.get("requests", {}).get("nvidia.com/gpu")
    check("container limits nvidia.com/gpu to a positive integer", isinstance(gl, int) and gl > 0, repr(gl))
    check("nvidia.com/gpu requests equal limits", gr is None or gr == gl, "%r vs %r" % (gr, gl))

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
        return
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
    needed = {a for a in entry + rcmd if a.startswith("/etc/dispatch/")}
    check("every file the ENTRYPOINT and the probe read is in the Secret volume",
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
    sp = svc["spec"]["ports"][0]
    check("Service targets the listen port", resolve(sp.get("targetPort", sp["port"])) == lport)
    np_ports = [p.get("port") for r in netpol["spec"].get("ingress", []) for p in r.get("ports", [])]
    check("NetworkPolicy admits the listen port only", [resolve(p) for p in np_ports] == [lport], repr(np_ports))

    text = open(os.path.join(K8S, "secret.yaml")).read()
    check("Secret holds placeholders, no key or certificate", "-----BEGIN" not in text)

    server = os.environ.get("DISPATCH_SERVER_BIN")
    if server:
        helptext = subprocess.run([server, "--help"], capture_output=True, text=True).stdout
        known = set(re.findall(r"^\s+(--[a-z-]+)", helptext, re.M))
        opts = [a.split("=")[0] for a in entry[1:] + c.get("args", []) if a.startswith("--")]
        unknown = [o for o in opts if o not in known]
        check("every option of ENTRYPOINT and args is one dispatch-server --help lists",
              bool(known) and not unknown, "unknown %s" % unknown)


K8S = sys.argv[1] if len(sys.argv) > 1 else "deploy/k8s"
main()
sys.exit(1 if failures else 0)
