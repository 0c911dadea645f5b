// Offline validation of Kubernetes manifests: every document against the API schemas of
// kubernetes-models (pinned in package.json), then the rules a cluster or its admission
// enforces that the schemas miss. Usage:
//   node validate.mjs FILE.yaml...   (a file may hold several documents; "-" reads stdin)
// Exit code 0 when every document passes, 1 with one line per problem otherwise.
import fs from "node:fs";
import path from "node:path";
import { parseAllDocuments } from "yaml";

const problems = [];
const docs = [];
for (const file of process.argv.slice(2)) {
  const text = file === "-" ? fs.readFileSync(0, "utf8") : fs.readFileSync(file, "utf8");
  for (const d of parseAllDocuments(text)) {
    if (d.errors.length) problems.push(`${file}: YAML: ${d.errors[0].message}`);
    const obj = d.toJS();
    if (obj && obj.kind !== "Kustomization") docs.push({ file: path.basename(file), obj });
  }
}
if (docs.length === 0) problems.push("no Kubernetes documents given");

const where = (d) => `${d.file}: ${d.obj.kind}/${d.obj.metadata?.name}`;

// 1. The API schema of each kind.
for (const d of docs) {
  const { apiVersion, kind } = d.obj;
  const [group, version] = apiVersion.includes("/") ? apiVersion.split("/") : ["", apiVersion];
  const modulePath = `kubernetes-models/${group ? group + "/" : ""}${version}/${kind}`;
  let Model;
  try {
    Model = (await import(modulePath))[kind];
  } catch {
    problems.push(`${where(d)}: unknown apiVersion/kind ${apiVersion} ${kind}`);
    continue;
  }
  try {
    new Model(d.obj).validate();
  } catch (e) {
    problems.push(`${where(d)}: schema: ${e.message}`);
  }
}

// 2. What the schemas miss.
const quantity = (q) => {
  const m = /^([0-9.]+)([a-zA-Z]*)$/.exec(String(q));
  if (!m) return NaN;
  const units = { "": 1, m: 1e-3, k: 1e3, M: 1e6, G: 1e9, T: 1e12, Ki: 2 ** 10, Mi: 2 ** 20,
                  Gi: 2 ** 30, Ti: 2 ** 40 };
  return units[m[2]] === undefined ? NaN : Number(m[1]) * units[m[2]];
};
const matches = (selector, labels) =>
  Object.entries(selector ?? {}).every(([k, v]) => (labels ?? {})[k] === v);
const workloads = docs.filter((d) =>
  ["Deployment", "StatefulSet", "Job", "DaemonSet"].includes(d.obj.kind));
const templates = workloads.map((d) => ({ d, labels: d.obj.spec?.template?.metadata?.labels ?? {},
                                          ns: d.obj.metadata?.namespace }));
const byKind = (kind) => docs.filter((d) => d.obj.kind === kind);
// Namespaces of these manifests with their labels (a cluster adds kubernetes.io/metadata.name).
const namespaces = byKind("Namespace").map((d) => ({
  ...(d.obj.metadata?.labels ?? {}),
  "kubernetes.io/metadata.name": d.obj.metadata?.name,
}));

for (const d of workloads) {
  const spec = d.obj.spec;
  const tpl = spec.template;
  if (d.obj.kind !== "Job") {
    const sel = spec.selector?.matchLabels;
    if (!sel || Object.keys(sel).length === 0) problems.push(`${where(d)}: selector has no matchLabels`);
    else if (!matches(sel, tpl.metadata?.labels)) {
      problems.push(`${where(d)}: selector ${JSON.stringify(sel)} does not match the template's labels`);
    }
  }
  if (d.obj.kind === "StatefulSet") {
    const svc = byKind("Service").find((s) => s.obj.metadata.name === spec.serviceName);
    if (!svc) problems.push(`${where(d)}: serviceName ${spec.serviceName} names no Service here`);
    else if (svc.obj.spec.clusterIP !== "None") {
      problems.push(`${where(d)}: serviceName ${spec.serviceName} is not headless`);
    }
  }
  const pod = tpl.spec;
  const psc = pod.securityContext ?? {};
  if (psc.runAsNonRoot !== true) problems.push(`${where(d)}: securityContext.runAsNonRoot must be true`);
  if (!Number.isInteger(psc.runAsUser) || psc.runAsUser === 0) {
    problems.push(`${where(d)}: securityContext.runAsUser must be a numeric non-root uid`);
  }
  if (!Number.isInteger(psc.fsGroup)) problems.push(`${where(d)}: securityContext.fsGroup must be set`);
  if (psc.seccompProfile?.type !== "RuntimeDefault") {
    problems.push(`${where(d)}: securityContext.seccompProfile.type must be RuntimeDefault`);
  }
  const volumes = new Map((pod.volumes ?? []).map((v) => [v.name, v]));
  for (const v of volumes.values()) {
    const claim = v.persistentVolumeClaim?.claimName;
    if (claim && !byKind("PersistentVolumeClaim").some((p) => p.obj.metadata.name === claim)) {
      problems.push(`${where(d)}: volume ${v.name} claims ${claim}, which is not defined here`);
    }
  }
  for (const c of pod.containers ?? []) {
    const at = `${where(d)} container ${c.name}`;
    const csc = c.securityContext ?? {};
    if (csc.allowPrivilegeEscalation !== false) problems.push(`${at}: allowPrivilegeEscalation must be false`);
    if (!(csc.capabilities?.drop ?? []).includes("ALL")) problems.push(`${at}: capabilities must drop ALL`);
    const req = c.resources?.requests ?? {}, lim = c.resources?.limits ?? {};
    for (const [k, v] of Object.entries(req)) {
      if (lim[k] !== undefined && quantity(v) > quantity(lim[k])) {
        problems.push(`${at}: requests.${k} ${v} exceeds limits.${k} ${lim[k]}`);
      }
    }
    for (const [k, v] of Object.entries({ ...req, ...lim })) {
      if (Number.isNaN(quantity(v))) problems.push(`${at}: resources ${k}: "${v}" is not a quantity`);
    }
    if (req["nvidia.com/gpu"] !== undefined && lim["nvidia.com/gpu"] === undefined) {
      problems.push(`${at}: nvidia.com/gpu must be in limits (extended resources)`);
    }
    if (req["nvidia.com/gpu"] !== undefined && lim["nvidia.com/gpu"] !== undefined &&
        quantity(req["nvidia.com/gpu"]) !== quantity(lim["nvidia.com/gpu"])) {
      problems.push(`${at}: nvidia.com/gpu request must equal its limit`);
    }
    const gpu = lim["nvidia.com/gpu"] !== undefined;
    const args = (c.args ?? []).join(" ");
    if (gpu && !/cuda/.test(c.image)) problems.push(`${at}: GPU container uses the CPU image ${c.image}`);
    if (gpu && !/--device cuda/.test(args)) problems.push(`${at}: GPU container without --device cuda:N`);
    for (const m of c.volumeMounts ?? []) {
      if (!volumes.has(m.name)) problems.push(`${at}: volumeMount ${m.name} names no volume`);
    }
    const env = new Set((c.env ?? []).map((e) => e.name));
    for (const ref of args.matchAll(/\$\(([A-Za-z_][A-Za-z0-9_]*)\)/g)) {
      if (!env.has(ref[1])) problems.push(`${at}: args use $(${ref[1]}), which env does not define`);
    }
    const ports = new Set((c.ports ?? []).flatMap((p) => [p.name, p.containerPort]));
    for (const probe of ["readinessProbe", "livenessProbe", "startupProbe"]) {
      const p = c[probe];
      if (!p) continue;
      const port = p.grpc?.port ?? p.httpGet?.port ?? p.tcpSocket?.port;
      if (port !== undefined && !ports.has(port)) {
        problems.push(`${at}: ${probe} port ${port} is not a container port`);
      }
    }
  }
}
for (const s of byKind("Service")) {
  const sel = s.obj.spec?.selector;
  if (sel && !templates.some((t) => matches(sel, t.labels))) {
    problems.push(`${where(s)}: selector ${JSON.stringify(sel)} matches no pod template here`);
  }
  for (const p of s.obj.spec?.ports ?? []) {
    if (typeof p.targetPort !== "string") continue;
    const named = templates.filter((t) => matches(sel, t.labels)).some((t) =>
      t.d.obj.spec.template.spec.containers.some((c) => (c.ports ?? []).some((cp) => cp.name === p.targetPort)));
    if (!named) problems.push(`${where(s)}: targetPort ${p.targetPort} names no container port`);
  }
}
for (const n of byKind("NetworkPolicy")) {
  const sel = n.obj.spec.podSelector?.matchLabels ?? {};
  if (!templates.some((t) => matches(sel, t.labels))) {
    problems.push(`${where(n)}: podSelector ${JSON.stringify(sel)} matches no pod template here`);
  }
  for (const rule of n.obj.spec.ingress ?? []) {
    for (const from of rule.from ?? []) {
      // A namespaceSelector with labels must name a namespace these manifests create (an
      // empty one admits every namespace).
      const ns = from.namespaceSelector?.matchLabels;
      if (ns && Object.keys(ns).length > 0 && !namespaces.some((l) => matches(ns, l))) {
        problems.push(`${where(n)}: from.namespaceSelector ${JSON.stringify(ns)} matches no namespace`);
      }
      const ps = from.podSelector?.matchLabels;
      if (!ps || from.namespaceSelector) continue;  // pods of another namespace: not ours to see
      if (!templates.some((t) => matches(ps, t.labels))) {
        problems.push(`${where(n)}: from.podSelector ${JSON.stringify(ps)} matches no pod`);
      }
    }
  }
}

for (const p of problems) console.log(p);
console.log(`${docs.length} documents, ${problems.length} problems`);
process.exit(problems.length === 0 ? 0 : 1);
