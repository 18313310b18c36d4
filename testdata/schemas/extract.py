"""Cut the schemas kvroute's manifests use out of upstream CRD files, as compact JSON.

    python testdata/schemas/extract.py CRD.yaml [CRD.yaml ...]

Keeps, for each (group/version, kind) in WANTED, the CRD's openAPIV3Schema without its
`description` texts (most of the bytes); everything that validates is kept as published,
`x-kubernetes-*` markers included. The sources and versions are in README.md.
"""
import json
import sys
from pathlib import Path

import yaml

WANTED = {
    ("extensions.istio.io/v1alpha1", "WasmPlugin"),
    ("networking.istio.io/v1alpha3", "EnvoyFilter"),
    ("networking.istio.io/v1", "DestinationRule"),
    ("gateway.networking.k8s.io/v1", "Gateway"),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"),
    ("inference.networking.k8s.io/v1", "InferencePool"),
    ("gateway.envoyproxy.io/v1alpha1", "EnvoyExtensionPolicy"),
    ("gateway.envoyproxy.io/v1alpha1", "BackendTrafficPolicy"),
    ("gateway.envoyproxy.io/v1alpha1", "EnvoyProxy"),
    ("gateway.envoyproxy.io/v1alpha1", "EnvoyPatchPolicy"),
}


def strip(node):
    if isinstance(node, list):
        return [strip(x) for x in node]
    if isinstance(node, dict):
        return {k: strip(v) for k, v in node.items() if k != "description"}
    return node


def main():
    out = Path(__file__).parent
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    for path in sys.argv[1:]:
        for doc in yaml.load_all(open(path), Loader=loader):
            if not doc or doc.get("kind") != "CustomResourceDefinition":
                continue
            group, kind = doc["spec"]["group"], doc["spec"]["names"]["kind"]
            for v in doc["spec"]["versions"]:
                api = f"{group}/{v['name']}"
                if (api, kind) not in WANTED:
                    continue
                schema = strip(v["schema"]["openAPIV3Schema"])
                name = f"{group}_{v['name']}_{kind}.json"
                text = json.dumps({"apiVersion": api, "kind": kind, "schema": schema},
                                  separators=(",", ":"), sort_keys=True)
                (out / name).write_text(text + "\n")
                print(name, len(text))


if __name__ == "__main__":
    main()
