#!/usr/bin/env python3
"""Checks the deployment files against the project they deploy.

Docker cannot run where the tests run, so the Dockerfile's build steps are tested by CI running
the same scripts; this test checks what can be checked without Docker or a cluster: that the
Dockerfile and every YAML file under deploy/ parse, and that the ports, flags, paths, binary
names, gRPC service names and labels they mention exist in the project and agree with each other
(the server's flag defaults in server/main.cc, the CLI's flags in client/attn_client.cc, the
executables of the CMake build, the proto's service).

  check_deploy_config.py --root=REPOSITORY_ROOT [--kubectl=KUBECTL]
      [--docker_compose=DOCKER_COMPOSE] [--compose_v2=COMPOSE_V2] [--docker=DOCKER] [TEST ...]

With --kubectl, KustomizeRenderTest also renders the kustomizations with `kubectl kustomize`.
With --docker_compose (Debian's docker-compose 1.29) and --compose_v2 (compose v2's own binary) or
--docker (compose v2 as `docker compose`, where that plugin is installed), ComposeCliTest has each
validate the compose files.
"""

import argparse
import fnmatch
import glob
import json
import os
import re
import subprocess
import sys
import unittest

import yaml

ROOT = ""  # set by main()
KUBECTL = ""  # set by main(): --kubectl, for KustomizeRenderTest
DOCKER_COMPOSE = ""  # set by main(): --docker_compose, for ComposeCliTest
DOCKER = ""  # set by main(): --docker, for ComposeCliTest
COMPOSE_V2 = ""  # set by main(): --compose_v2, for ComposeCliTest

# Flags abseil itself defines for every binary.
ABSL_BUILTIN_FLAGS = {"help", "helpfull", "helpshort", "helppackage", "version", "flagfile",
                      "fromenv", "tryfromenv", "undefok"}


def read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def flag_defaults(source):
    """{name: (type, default)} of the ABSL_FLAGs defined in `source`."""
    pattern = re.compile(r'ABSL_FLAG\(\s*([^,]+?),\s*(\w+),\s*("(?:[^"\\]|\\.)*"|[^,]+?)\s*,')
    return {m.group(2): (m.group(1).strip(), m.group(3).strip().strip('"'))
            for m in pattern.finditer(read(source))}


class Project:
    """What the project defines, read from its sources."""

    def __init__(self):
        self.server_flags = flag_defaults("server/main.cc")
        self.client_flags = flag_defaults("client/attn_client.cc")
        self.grpc_port = int(self.server_flags["port"][1])
        self.metrics_port = int(self.server_flags["metrics_port"][1])
        self.shutdown_grace_s = int(self.server_flags["shutdown_grace_s"][1])
        # executable name -> the folder whose CMakeLists.txt defines it (its build/ subfolder).
        self.executables = {}
        self.cmake_options = set()
        for path in glob.glob(os.path.join(ROOT, "**", "CMakeLists.txt"), recursive=True):
            folder = os.path.relpath(os.path.dirname(path), ROOT)
            if folder.startswith("build") or "/build" in folder:
                continue
            text = read(os.path.relpath(path, ROOT))
            for name in re.findall(r"add_executable\(\s*(\w+)", text):
                self.executables[name] = folder
            self.cmake_options.update(re.findall(r"option\(\s*(\w+)", text))
        proto = read("proto/attention/v1/attention.proto")
        package = re.search(r"^package\s+([\w.]+);", proto, re.M).group(1)
        # "" is the server as a whole in grpc.health.v1.
        self.grpc_services = {""} | {f"{package}.{s}"
                                     for s in re.findall(r"^service\s+(\w+)", proto, re.M)}


PROJECT = None  # set by main()


def flag_name(arg):
    """'--port=1' -> 'port'; None for an argument that is not a flag."""
    m = re.match(r"--?([A-Za-z_]\w*)(=.*)?$", arg)
    return m.group(1) if m else None


def flag_values(args):
    """{name: value} of the --name=value flags in `args`."""
    return {m.group(1): m.group(2) for m in (re.match(r"--?(\w+)=(.*)$", a) for a in args) if m}


def unknown_flags(args, flags):
    """The flags of `args` that are not in `flags` (absl's --noNAME counts for a bool NAME)."""
    unknown = []
    for arg in args:
        name = flag_name(arg)
        if name is None or name in flags or name in ABSL_BUILTIN_FLAGS:
            continue
        if name.startswith("no") and flags.get(name[2:], ("",))[0] == "bool":
            continue
        unknown.append(arg)
    return unknown


def image_repository(image):
    """'registry/attention-server:1.0' -> 'attention-server'."""
    return image.rsplit("/", 1)[-1].split("@")[0].split(":")[0]


# --- The Dockerfile ------------------------------------------------------------------------------

def parse_dockerfile(text):
    """[(INSTRUCTION, arguments)], continuation lines joined, comments dropped."""
    instructions, current = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or (not stripped and not current):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        current += stripped
        keyword, _, arguments = current.partition(" ")
        instructions.append((keyword.upper(), arguments.strip()))
        current = ""
    return instructions


def exec_form(arguments):
    """The argv of an exec-form (JSON array) CMD, ENTRYPOINT or HEALTHCHECK CMD."""
    return json.loads(arguments)


class Dockerfile:
    def __init__(self):
        self.text = read("Dockerfile")
        self.instructions = parse_dockerfile(self.text)
        # Build arguments with defaults, substituted into FROM lines.
        self.args = {}
        for keyword, arguments in self.instructions:
            if keyword == "ARG" and "=" in arguments:
                name, _, value = arguments.partition("=")
                self.args.setdefault(name, value.strip('"'))
        self.stages = []  # (image, stage name)
        for keyword, arguments in self.instructions:
            if keyword == "FROM":
                parts = arguments.split()
                image = re.sub(r"\$\{(\w+)\}", lambda m: self.args[m.group(1)], parts[0])
                name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else None
                self.stages.append((image, name))
        self.tag = re.search(r"docker build -t (\S+) \.", self.text).group(1)

    def all(self, keyword):
        return [arguments for k, arguments in self.instructions if k == keyword]

    def last(self, keyword):
        values = self.all(keyword)
        return values[-1] if values else None


def dockerignore_patterns():
    patterns = []
    for line in read(".dockerignore").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            patterns.append(line.rstrip("/"))
    return patterns


def dockerignored(path, patterns):
    """Whether `path` (or a folder above it) is excluded from the build context."""
    parts = path.strip("/").split("/")
    ignored = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        pattern = pattern.lstrip("!").lstrip("/")
        for i in range(1, len(parts) + 1):
            if fnmatch.fnmatchcase("/".join(parts[:i]), pattern):
                ignored = not negated
    return ignored


class DockerfileTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.docker = Dockerfile()

    def test_builds_in_cuda13_devel_and_runs_in_cuda13_runtime_ubuntu2404(self):
        self.assertGreaterEqual(len(self.docker.stages), 2, "multi-stage build")
        build_image, runtime_image = self.docker.stages[0][0], self.docker.stages[-1][0]
        self.assertRegex(build_image,
                         r"^docker\.io/nvidia/cuda:13\.\d+(\.\d+)?-devel-ubuntu24\.04$")
        self.assertRegex(runtime_image,
                         r"^docker\.io/nvidia/cuda:13\.\d+(\.\d+)?-runtime-ubuntu24\.04$")

    def test_from_images_are_fully_qualified(self):
        # podman (and docker with short-name resolution off) refuse "nvidia/cuda": the first
        # component must name the registry, a host with a dot or port, or localhost.
        earlier_stages = set()
        for image, name in self.docker.stages:
            if image not in earlier_stages:
                registry = image.split("/", 1)[0]
                self.assertTrue("/" in image and ("." in registry or ":" in registry
                                                  or registry == "localhost"),
                                f"FROM {image}: name the registry (docker.io/...)")
            if name:
                earlier_stages.add(name)

    def test_builds_with_the_scripts_ci_runs(self):
        runs = " ".join(self.docker.all("RUN"))
        for script in ("scripts/install_deps.sh", "scripts/build.sh"):
            self.assertIn(f"./{script}", runs)
        for script in re.findall(r"scripts/[\w./-]+\.sh", runs):
            path = os.path.join(ROOT, script)
            self.assertTrue(os.access(path, os.X_OK), f"{script} is missing or not executable")

    def test_cmake_options_exist(self):
        for name in re.findall(r"-D(\w+)=", " ".join(self.docker.all("RUN"))):
            if not name.startswith("CMAKE_"):
                self.assertIn(name, PROJECT.cmake_options, f"-D{name}: no such option()")

    def test_binaries_come_from_the_build(self):
        runs = " ".join(self.docker.all("RUN"))
        built = re.findall(r"\bbuild/([\w/]+)/(\w+)\b", runs)
        self.assertTrue(built, "no binary copied out of build/")
        for folder, name in built:
            self.assertEqual(PROJECT.executables.get(name), folder,
                             f"build/{folder}/{name}: no add_executable({name}) in "
                             f"{folder}/CMakeLists.txt")
        names = {name for _, name in built}
        entrypoint = exec_form(self.docker.last("ENTRYPOINT"))
        health = exec_form(self.docker.last("HEALTHCHECK").split(" CMD ", 1)[1])
        self.assertIn(entrypoint[0], names)
        self.assertIn(health[0], names)

    def test_copy_sources_exist_and_are_in_the_build_context(self):
        stage_names = {name for _, name in self.docker.stages if name}
        patterns = dockerignore_patterns()
        for arguments in self.docker.all("COPY"):
            words = arguments.split()
            options = [w for w in words if w.startswith("--")]
            sources = [w for w in words if not w.startswith("--")][:-1]
            from_stage = [o.split("=", 1)[1] for o in options if o.startswith("--from=")]
            if from_stage:
                self.assertIn(from_stage[0], stage_names)
                continue
            for source in sources:
                self.assertTrue(os.path.exists(os.path.join(ROOT, source)), source)
                if source != ".":
                    self.assertFalse(dockerignored(source, patterns), f"{source} is .dockerignored")

    def test_dockerignore_keeps_sources_and_drops_build_trees(self):
        patterns = dockerignore_patterns()
        top_level = set(re.findall(r"add_subdirectory\((\w+)\)", read("CMakeLists.txt")))
        for path in sorted(top_level | {"CMakeLists.txt", "scripts/build.sh",
                                        "scripts/install_deps.sh"}):
            self.assertFalse(dockerignored(path, patterns), f"{path} is .dockerignored")
        # A copied build/ would carry a CMakeCache.txt naming another source folder.
        for path in ("build", "build-cpu", ".git", ".deploy-tools"):
            self.assertTrue(dockerignored(path, patterns), f"{path} is in the build context")

    def test_runs_as_non_root(self):
        user = self.docker.last("USER")
        uid = user.split(":")[0]
        self.assertTrue(uid.isdigit() and int(uid) != 0, f"USER {user}: a numeric non-root uid")
        self.assertIn(f"--uid {uid}", " ".join(self.docker.all("RUN")))

    def test_exposes_the_servers_ports(self):
        exposed = {int(p.split("/")[0]) for e in self.docker.all("EXPOSE") for p in e.split()}
        flags = flag_values(exec_form(self.docker.last("CMD")))
        self.assertEqual(exposed, {int(flags.get("port", PROJECT.grpc_port)),
                                   int(flags.get("metrics_port", PROJECT.metrics_port))})

    def test_server_flags_exist(self):
        self.assertEqual(exec_form(self.docker.last("ENTRYPOINT")), ["attention_server"])
        cmd = exec_form(self.docker.last("CMD"))
        self.assertEqual(unknown_flags(cmd, PROJECT.server_flags), [])

    def test_healthcheck_calls_the_health_service(self):
        health = exec_form(self.docker.last("HEALTHCHECK").split(" CMD ", 1)[1])
        self.assertEqual(health[0], "attn_client")
        self.assertIn("--health", health)
        self.assertEqual(unknown_flags(health[1:], PROJECT.client_flags), [])
        port = int(flag_values(exec_form(self.docker.last("CMD"))).get("port", PROJECT.grpc_port))
        self.assertEqual(flag_values(health[1:]).get("target"), f"localhost:{port}")

    def test_paths_in_comments_exist(self):
        for path in re.findall(r"\b(deploy/[\w./-]*\w)", self.docker.text):
            self.assertTrue(os.path.exists(os.path.join(ROOT, path)), path)


# --- YAML under deploy/ ---------------------------------------------------------------------------

def deploy_yaml_files():
    files = []
    for pattern in ("*.yml", "*.yaml"):
        files += glob.glob(os.path.join(ROOT, "deploy", "**", pattern), recursive=True)
    return sorted(os.path.relpath(f, ROOT) for f in files)


def load_documents():
    """{path: [document]} for every YAML file under deploy/."""
    return {path: [d for d in yaml.safe_load_all(read(path)) if d is not None]
            for path in deploy_yaml_files()}


def docs_of_kind(documents, kind):
    return [(path, d) for path, docs in documents.items() for d in docs
            if isinstance(d, dict) and d.get("kind") == kind and "apiVersion" in d]


def is_subset(small, big):
    return all(big.get(k) == v for k, v in (small or {}).items())


def server_containers(pod_spec, tag):
    return [c for c in pod_spec.get("containers", [])
            if image_repository(c.get("image", "")) == image_repository(tag)]


class DeployYamlTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.docker = Dockerfile()
        cls.documents = load_documents()

    def test_every_yaml_file_parses(self):
        self.assertTrue(self.documents, "no YAML under deploy/")
        for path, docs in self.documents.items():
            self.assertTrue(docs, f"{path} is empty")

    def test_compose_runs_the_dockerfiles_image(self):
        compose = [(p, d) for p, docs in self.documents.items() for d in docs
                   if isinstance(d, dict) and "services" in d]
        self.assertTrue(compose, "no compose file under deploy/")
        images = []
        for path, doc in compose:
            folder = os.path.dirname(path)
            for name, service in doc["services"].items():
                for volume in service.get("volumes", []):
                    host = volume.split(":")[0]
                    if host.startswith("."):
                        self.assertTrue(os.path.exists(os.path.join(ROOT, folder, host)),
                                        f"{path}: {name} mounts {host}")
                if "image" in service:
                    images.append(service["image"])
                if image_repository(service.get("image", "")) != image_repository(self.docker.tag):
                    continue
                command = service.get("command", [])
                self.assertEqual(unknown_flags(command, PROJECT.server_flags), [],
                                 f"{path}: {name}")
                flags = flag_values(command)
                ports = {int(flags.get("port", PROJECT.grpc_port)),
                         int(flags.get("metrics_port", PROJECT.metrics_port))}
                for mapping in service.get("ports", []) + service.get("expose", []):
                    self.assertIn(int(str(mapping).split(":")[-1]), ports, f"{path}: {name}")
                health = service.get("healthcheck", {}).get("test")
                if health:
                    argv = health[1:] if health[0] in ("CMD", "CMD-SHELL") else health
                    self.assertEqual(argv[0], "attn_client", f"{path}: {name}")
                    self.assertEqual(unknown_flags(argv[1:], PROJECT.client_flags), [])
                    self.assertEqual(flag_values(argv[1:]).get("target"),
                                     f"localhost:{flags.get('port', PROJECT.grpc_port)}")
                grace = service.get("stop_grace_period")
                if grace:
                    self.assertGreater(int(str(grace).rstrip("s")),
                                       int(flags.get("shutdown_grace_s",
                                                     PROJECT.shutdown_grace_s)),
                                       f"{path}: {name}: stop_grace_period under the drain")
        self.assertIn(self.docker.tag, images, "no compose service runs the Dockerfile's image")

    def test_prometheus_scrapes_the_metrics_port(self):
        configs = [(p, d) for p, docs in self.documents.items() for d in docs
                   if isinstance(d, dict) and "scrape_configs" in d]
        for path, config in configs:
            for pattern in config.get("rule_files", []):
                matched = glob.glob(os.path.join(ROOT, os.path.dirname(path), pattern))
                self.assertTrue(matched, f"{path}: rule_files {pattern} matches nothing")
            for job in config["scrape_configs"]:
                for static in job.get("static_configs", []):
                    for target in static.get("targets", []):
                        self.assertEqual(int(target.rsplit(":", 1)[1]), PROJECT.metrics_port,
                                         f"{path}: {target}")


class KubernetesTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.docker = Dockerfile()
        documents = load_documents()
        cls.k8s = {p: d for p, d in documents.items() if p.startswith("deploy/k8s/")}
        cls.rule_jobs = set()
        cls.prometheus_jobs = set()
        for path, docs in documents.items():
            for doc in docs:
                if isinstance(doc, dict) and "groups" in doc:
                    cls.rule_jobs |= set(re.findall(r'job="(\w+)"', yaml.safe_dump(doc)))
                if isinstance(doc, dict) and "scrape_configs" in doc:
                    cls.prometheus_jobs |= {j["job_name"] for j in doc["scrape_configs"]}
        # A StatefulSet: stable pod names and DNS names, for routing sessions to their owner.
        workloads = docs_of_kind(cls.k8s, "StatefulSet")
        assert len(workloads) == 1, "deploy/k8s: expected one StatefulSet"
        assert docs_of_kind(cls.k8s, "Deployment") == [], "deploy/k8s: a Deployment"
        cls.workload = workloads[0][1]
        cls.pod = cls.workload["spec"]["template"]
        cls.container = server_containers(cls.pod["spec"], cls.docker.tag)[0]
        cls.args = cls.container.get("args", [])
        cls.flags = flag_values(cls.args)
        cls.ports = {p["name"]: p["containerPort"] for p in cls.container["ports"]}

    def test_each_pod_names_its_sessions_after_itself(self):
        # --replica_name is the pod's name, through the downward API (Kubernetes expands $(VAR)
        # in args), and fits the flag: 1..32 of a-z, 0-9 and '-' for every ordinal up to 9999.
        self.assertEqual(self.flags.get("replica_name"), "$(POD_NAME)")
        env = {e["name"]: e for e in self.container.get("env", [])}
        self.assertEqual(env["POD_NAME"].get("valueFrom"),
                         {"fieldRef": {"fieldPath": "metadata.name"}})
        longest = f"{self.workload['metadata']['name']}-9999"
        self.assertRegex(longest, r"^[a-z0-9-]{1,32}$")
        # Each pod's DNS name, NAME.SERVICE.NAMESPACE.svc, comes from the headless Service.
        services = {s["metadata"]["name"]: s for _, s in docs_of_kind(self.k8s, "Service")}
        service = services.get(self.workload["spec"].get("serviceName"))
        self.assertIsNotNone(service, "serviceName: not a Service of deploy/k8s")
        self.assertEqual(service["spec"].get("clusterIP"), "None")

    def test_workload_runs_the_image_with_existing_flags(self):
        self.assertEqual(image_repository(self.container["image"]),
                         image_repository(self.docker.tag))
        self.assertNotIn("command", self.container, "the image's ENTRYPOINT is the server")
        self.assertEqual(unknown_flags(self.args, PROJECT.server_flags), [])
        self.assertTrue(is_subset(self.workload["spec"]["selector"]["matchLabels"],
                                  self.pod["metadata"]["labels"]))

    def test_container_ports_match_the_flags(self):
        self.assertEqual(self.ports["grpc"], int(self.flags.get("port", PROJECT.grpc_port)))
        self.assertEqual(self.ports["metrics"],
                         int(self.flags.get("metrics_port", PROJECT.metrics_port)))

    def test_requests_a_gpu_cpu_and_memory(self):
        requests = self.container["resources"]["requests"]
        for resource in ("nvidia.com/gpu", "cpu", "memory"):
            self.assertIn(resource, requests)
        self.assertEqual(self.container["resources"]["limits"].get("nvidia.com/gpu"),
                         requests["nvidia.com/gpu"])

    def test_probes_call_the_grpc_health_service(self):
        for probe in ("readinessProbe", "livenessProbe"):
            grpc = self.container[probe].get("grpc")
            self.assertIsNotNone(grpc, f"{probe} is not a gRPC probe")
            self.assertEqual(grpc["port"], self.ports["grpc"], probe)
            self.assertIn(grpc.get("service", ""), PROJECT.grpc_services, probe)
        # Readiness follows the Attention service, which turns NOT_SERVING when the drain starts.
        self.assertEqual(self.container["readinessProbe"]["grpc"].get("service"),
                         "attention.v1.Attention")

    def test_termination_grace_covers_the_drain(self):
        grace_s = int(self.flags.get("shutdown_grace_s", PROJECT.shutdown_grace_s))
        pre_stop = self.container.get("lifecycle", {}).get("preStop", {}).get("exec", {})
        command = pre_stop.get("command", [])
        pause_s = int(command[1]) if command[:1] == ["sleep"] else 0
        self.assertGreater(self.pod["spec"]["terminationGracePeriodSeconds"], grace_s + pause_s)

    def test_runs_as_the_images_non_root_user(self):
        uid = int(self.docker.last("USER").split(":")[0])
        context = self.pod["spec"].get("securityContext", {})
        self.assertTrue(context.get("runAsNonRoot"))
        self.assertEqual(context.get("runAsUser"), uid)

    def test_headless_service_selects_the_pods(self):
        services = docs_of_kind(self.k8s, "Service")
        self.assertTrue(services)
        for path, service in services:
            spec = service["spec"]
            self.assertEqual(spec.get("clusterIP"), "None", f"{path}: not headless")
            self.assertTrue(is_subset(spec["selector"], self.pod["metadata"]["labels"]), path)
            for port in spec["ports"]:
                target = port.get("targetPort", port["port"])
                if isinstance(target, str):
                    self.assertIn(target, self.ports, path)
                    target = self.ports[target]
                self.assertIn(target, self.ports.values(), path)

    def test_service_monitor_scrapes_metrics_as_the_alerts_job(self):
        monitors = docs_of_kind(self.k8s, "ServiceMonitor") + docs_of_kind(self.k8s, "PodMonitor")
        self.assertTrue(monitors, "no ServiceMonitor or PodMonitor")
        services = [s for _, s in docs_of_kind(self.k8s, "Service")]
        for path, monitor in monitors:
            spec = monitor["spec"]
            selector = spec["selector"]["matchLabels"]
            if monitor["kind"] == "ServiceMonitor":
                selected = [s for s in services if is_subset(selector, s["metadata"]["labels"])]
                self.assertEqual(len(selected), 1, f"{path}: selects {len(selected)} Services")
                service = selected[0]
                port_names = {p["name"] for p in service["spec"]["ports"]}
                job_label = spec.get("jobLabel")
                job = (service["metadata"]["labels"][job_label] if job_label
                       else service["metadata"]["name"])
                endpoints = spec["endpoints"]
            else:
                self.assertTrue(is_subset(selector, self.pod["metadata"]["labels"]), path)
                port_names = set(self.ports)
                job = self.pod["metadata"]["labels"].get(spec.get("jobLabel", ""))
                endpoints = spec["podMetricsEndpoints"]
            for endpoint in endpoints:
                self.assertIn(endpoint["port"], port_names, path)
                self.assertEqual(self.ports[endpoint["port"]],
                                 int(self.flags.get("metrics_port", PROJECT.metrics_port)))
                self.assertEqual(endpoint.get("path", "/metrics"), "/metrics", path)
            for jobs, what in ((self.rule_jobs, "alert rules"),
                               (self.prometheus_jobs, "prometheus.yml")):
                if jobs:
                    self.assertIn(job, jobs, f"{path}: job {job!r} is not the {what}' job")

    def test_disruption_budget_selects_the_pods(self):
        budgets = docs_of_kind(self.k8s, "PodDisruptionBudget")
        self.assertTrue(budgets)
        for path, budget in budgets:
            self.assertTrue(is_subset(budget["spec"]["selector"]["matchLabels"],
                                      self.pod["metadata"]["labels"]), path)

    def test_kustomization_lists_every_manifest(self):
        # Each kustomization (the base, its components) lists every manifest beside it.
        folders = {os.path.dirname(p) for p in self.k8s}
        for folder in folders:
            kustomization = yaml.safe_load(read(f"{folder}/kustomization.yaml"))
            listed = {r for r in kustomization.get("resources", []) if "/" not in r}
            present = {os.path.basename(p) for p in self.k8s
                       if os.path.dirname(p) == folder} - {"kustomization.yaml"}
            self.assertEqual(listed, present, folder)


# --- Kustomize: the base without the Prometheus Operator, the component with it ------------------

OPERATOR_GROUP = "monitoring.coreos.com"
BASE = "deploy/k8s"
OPERATOR_COMPONENT = "deploy/k8s/components/prometheus-operator"
OPERATOR_OVERLAY = "deploy/k8s-prometheus-operator"


def kustomization(folder):
    return yaml.safe_load(read(f"{folder}/kustomization.yaml"))


def kustomize_documents(folder):
    """The documents the kustomization in `folder` builds, by following its resources and
    components (none of ours patches or generates anything, so that is the whole build)."""
    documents = []
    spec = kustomization(folder)
    for entry in spec.get("resources", []) + spec.get("components", []):
        path = os.path.normpath(os.path.join(folder, entry))
        if os.path.isdir(os.path.join(ROOT, path)):
            documents += kustomize_documents(path)
        else:
            documents += [d for d in yaml.safe_load_all(read(path)) if d is not None]
    return documents


def api_group(document):
    api_version = document.get("apiVersion", "")
    return api_version.split("/")[0] if "/" in api_version else ""


def operator_kinds(documents):
    return sorted(d["kind"] for d in documents if api_group(d) == OPERATOR_GROUP)


class KustomizeTest(unittest.TestCase):
    def test_base_applies_without_the_prometheus_operator(self):
        spec = kustomization(BASE)
        self.assertEqual(spec["kind"], "Kustomization")
        self.assertNotIn("components", spec, f"{BASE}: components need their CRDs")
        documents = kustomize_documents(BASE)
        self.assertEqual(operator_kinds(documents), [],
                         f"{BASE} needs the Prometheus Operator's CRDs")
        self.assertEqual(sorted(d["kind"] for d in documents),
                         ["PodDisruptionBudget", "Service", "StatefulSet"])

    def test_operator_component_adds_the_service_monitor(self):
        spec = kustomization(OPERATOR_COMPONENT)
        self.assertEqual(spec["apiVersion"], "kustomize.config.k8s.io/v1alpha1")
        self.assertEqual(spec["kind"], "Component")
        self.assertIn("ServiceMonitor", operator_kinds(kustomize_documents(OPERATOR_COMPONENT)))

    def test_operator_overlay_is_the_base_plus_the_component(self):
        spec = kustomization(OPERATOR_OVERLAY)
        self.assertEqual(spec["kind"], "Kustomization")
        resolve = lambda entries: [os.path.normpath(os.path.join(OPERATOR_OVERLAY, e))
                                   for e in entries]
        self.assertEqual(resolve(spec.get("resources", [])), [BASE])
        self.assertEqual(resolve(spec.get("components", [])), [OPERATOR_COMPONENT])

    def test_readme_gives_both_commands(self):
        text = read("deploy/README.md")
        for folder in (BASE, OPERATOR_OVERLAY):
            self.assertTrue(re.search(rf"kubectl apply -k {re.escape(folder)}(?![\w/-])", text),
                            f"deploy/README.md lacks `kubectl apply -k {folder}`")


class KustomizeRenderTest(unittest.TestCase):
    """`kubectl kustomize` renders both (run with --kubectl=PATH; skipped without)."""

    def render(self, folder):
        if not KUBECTL:
            self.skipTest("no --kubectl given")
        result = subprocess.run([KUBECTL, "kustomize", os.path.join(ROOT, folder)],
                                capture_output=True, text=True, timeout=60)
        self.assertEqual(result.returncode, 0, f"kubectl kustomize {folder}:\n{result.stderr}")
        return [d for d in yaml.safe_load_all(result.stdout) if d is not None]

    def test_base_renders_without_operator_kinds(self):
        documents = self.render(BASE)
        self.assertEqual(operator_kinds(documents), [])
        self.assertEqual(sorted(d["kind"] for d in documents),
                         ["PodDisruptionBudget", "Service", "StatefulSet"])

    def test_operator_overlay_renders_the_base_and_the_service_monitor(self):
        base = self.render(BASE)
        documents = self.render(OPERATOR_OVERLAY)
        self.assertEqual(operator_kinds(documents), ["ServiceMonitor"])
        self.assertEqual([d for d in documents if api_group(d) != OPERATOR_GROUP], base)


COMPOSE_FILES = ["deploy/compose/docker-compose.yml", "deploy/compose/docker-compose.gpu.yml"]
# The top-level keys both compose v2 and Debian 12's docker-compose 1.29 take: 1.29 refuses
# `name`, v2 warns that `version` is obsolete.
COMPOSE_TOP_LEVEL_KEYS = {"services", "volumes", "networks", "configs", "secrets"}


class ComposeTest(unittest.TestCase):
    def test_top_level_keys_both_compose_versions_take(self):
        for path in COMPOSE_FILES:
            with self.subTest(path=path):
                keys = set(yaml.safe_load(read(path)))
                self.assertEqual({k for k in keys if not k.startswith("x-")}
                                 - COMPOSE_TOP_LEVEL_KEYS, set())

    def test_project_named_by_the_env_file(self):
        self.assertIn("COMPOSE_PROJECT_NAME=attention\n", read("deploy/compose/.env"))


class ComposeCliTest(unittest.TestCase):
    """`config -q` of both files, alone and with the GPU override, by docker-compose 1.29
    (--docker_compose) and compose v2 (--compose_v2, or --docker when `docker compose` runs);
    skipped without."""

    def validate(self, command):
        for files in (COMPOSE_FILES[:1], COMPOSE_FILES):
            args = [a for f in files for a in ("-f", os.path.join(ROOT, f))]
            result = subprocess.run(command + args + ["config", "-q"], capture_output=True,
                                    text=True, timeout=60)
            self.assertEqual(result.returncode, 0, f"{command} {files}:\n{result.stderr}")
            self.assertNotIn("obsolete", result.stderr)

    def test_docker_compose_1_29(self):
        if not DOCKER_COMPOSE:
            self.skipTest("no --docker_compose given")
        self.validate([DOCKER_COMPOSE])

    def test_compose_v2(self):
        if COMPOSE_V2:
            command = [COMPOSE_V2]
        elif os.access(DOCKER, os.X_OK) and subprocess.run(
                [DOCKER, "compose", "version"], capture_output=True).returncode == 0:
            command = [DOCKER, "compose"]
        else:
            self.skipTest("no --compose_v2 given, nor a --docker with the compose v2 plugin")
        version = subprocess.run(command + ["version"], capture_output=True, text=True,
                                 timeout=60).stdout
        self.assertRegex(version, r"version v?2\.", f"{command} is not compose v2")
        self.validate(command)


def markdown_anchors(text):
    """The anchors GitHub gives the headings of a Markdown text: lower case, punctuation other
    than '-' and '_' dropped, spaces turned into '-'."""
    anchors = set()
    in_code = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        m = None if in_code else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            heading = re.sub(r"[^\w\- ]", "", m.group(1).replace("`", "").lower())
            anchors.add(heading.replace(" ", "-"))
    return anchors


class RunbookTest(unittest.TestCase):
    """Every alert links its runbook: a section of deploy/README.md, by a URL relative to the
    repository root (deploy/README.md#runbook-<alert name in lower case>)."""

    def test_every_alert_has_a_runbook_section(self):
        anchors = markdown_anchors(read("deploy/README.md"))
        alerts = 0
        for path in glob.glob(os.path.join(ROOT, "deploy", "prometheus", "rules", "*.yml")):
            rules = yaml.safe_load(read(os.path.relpath(path, ROOT)))
            for group in rules["groups"]:
                for rule in group["rules"]:
                    if "alert" not in rule:
                        continue
                    alerts += 1
                    name = rule["alert"]
                    url = rule.get("annotations", {}).get("runbook_url")
                    self.assertEqual(url, f"deploy/README.md#runbook-{name.lower()}",
                                     f"{name}: runbook_url")
                    document, _, anchor = url.partition("#")
                    self.assertTrue(os.path.exists(os.path.join(ROOT, document)), url)
                    self.assertIn(anchor, anchors,
                                  f"{name}: no heading 'Runbook: {name}' in deploy/README.md")
        self.assertGreater(alerts, 0, "no alerts under deploy/prometheus/rules")


class ReadmeTest(unittest.TestCase):
    def test_paths_and_flags_in_deploy_readme_exist(self):
        text = read("deploy/README.md")
        for path in re.findall(r"\b((?:deploy|scripts|tests)/[\w./-]*\w)", text):
            self.assertTrue(os.path.exists(os.path.join(ROOT, path)), path)
        # A command runs from the binary's name (or the image's, whose arguments go to the
        # server) to the end of its code span or line.
        commands = {"attention_server": PROJECT.server_flags,
                    "attention-server:latest": PROJECT.server_flags,
                    "attn_client": PROJECT.client_flags}
        for line in text.splitlines():
            pattern = r"(?<![\w/-])(attention_server|attention-server:latest|attn_client)([^`]*)"
            for m in re.finditer(pattern, line):
                words = re.findall(r"(?<![\w-])--\w+", m.group(2))
                self.assertEqual(unknown_flags(words, commands[m.group(1)]), [], line)

def main():
    global ROOT, PROJECT, KUBECTL, DOCKER_COMPOSE, DOCKER, COMPOSE_V2
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True, help="the repository root")
    parser.add_argument("--kubectl", default="", help="kubectl, to render the kustomizations")
    parser.add_argument("--docker_compose", default="", help="docker-compose 1.29")
    parser.add_argument("--compose_v2", default="", help="compose v2's docker-compose binary")
    parser.add_argument("--docker", default="", help="docker, for `docker compose` (v2)")
    args, rest = parser.parse_known_args()
    ROOT = os.path.abspath(args.root)
    KUBECTL = args.kubectl
    DOCKER_COMPOSE = args.docker_compose
    DOCKER = args.docker
    COMPOSE_V2 = args.compose_v2
    PROJECT = Project()
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)


if __name__ == "__main__":
    main()
