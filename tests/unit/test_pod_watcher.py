"""PodWatcher with the real `kubernetes` client against a stand-in API server.

There is no Kubernetes API server here: a small HTTP server answers the two
calls the watcher makes (list pods, then watch from the list's
resourceVersion) with recorded pod objects (fixtures/k8s/pods.json).
"""

from __future__ import annotations

import copy
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

from agent.identity.kubernetes import PodIndex, PodWatcher

PODS = json.loads((Path(__file__).parent / "fixtures" / "k8s" / "pods.json").read_text())["items"]


def _serve(requests: list[dict], new_pod: dict, gone_pod: dict):
    """Lists return the node's pods as they are; a watch adds new_pod and
    deletes gone_pod, which later lists then reflect (as a real server's would)."""
    pods = list(PODS)

    class Api(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            url = urlparse(self.path)
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            requests.append({"path": url.path, **query})
            if url.path != "/api/v1/pods":
                self.send_error(404)
                return
            if query.get("watch") in ("true", "True", "1"):
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                for kind, pod in (("ADDED", new_pod), ("DELETED", gone_pod)):
                    if kind == "ADDED" and pod not in pods:
                        pods.append(pod)
                    elif kind == "DELETED" and pod in pods:
                        pods.remove(pod)
                    self.wfile.write((json.dumps({"type": kind, "object": pod}) + "\n").encode())
                    self.wfile.flush()
                time.sleep(0.5)  # then the watch times out and the client relists
                return
            body = json.dumps({"apiVersion": "v1", "kind": "PodList",
                               "metadata": {"resourceVersion": "1000"}, "items": pods}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Api)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _wait(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_lists_then_watches_this_nodes_pods(tmp_path, monkeypatch):
    new_pod = copy.deepcopy(PODS[0])
    new_pod["metadata"].update(name="vllm-7d9f8c6b5-zzzzz", uid="aaaaaaaa-1111-4222-8333-444444444444")
    gone_pod = PODS[-1]
    requests: list[dict] = []
    server = _serve(requests, new_pod, gone_pod)
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "test", "cluster": {"server": f"http://127.0.0.1:{server.server_address[1]}"}}],
        "users": [{"name": "test", "user": {"token": "t"}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
    }))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    index = PodIndex()
    watcher = PodWatcher(index, node_name="gpu-node-1", backoff_s=0.05, max_backoff_s=0.05)
    try:
        assert watcher.start() is True
        _wait(lambda: index.get(new_pod["metadata"]["uid"]) is not None)
        _wait(lambda: index.get(gone_pod["metadata"]["uid"]) is None)
    finally:
        watcher.stop()
        server.shutdown()
    for pod in PODS[:-1]:
        info = index.get(pod["metadata"]["uid"])
        assert info is not None and info.name == pod["metadata"]["name"]
    assert index.get(new_pod["metadata"]["uid"]).name == "vllm-7d9f8c6b5-zzzzz"
    listed = [r for r in requests if r.get("watch") is None]
    watched = [r for r in requests if r.get("watch") is not None]
    assert listed and watched
    assert all(r["fieldSelector"] == "spec.nodeName=gpu-node-1" for r in listed + watched)
    assert watched[0]["resourceVersion"] == "1000"
