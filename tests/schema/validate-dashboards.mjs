// Validates Grafana dashboards against Grafana's own dashboard model.
//
//   node validate-dashboards.mjs MODULES_DIR DASHBOARD.json...
//
// MODULES_DIR is the node_modules that scripts/setup-grafana-schema.sh installed
// from tests/schema/package.json. For each dashboard, the @grafana/schema release
// that carries its schemaVersion has its TypeScript `Dashboard` type turned into
// a JSON Schema (ts-json-schema-generator): every interface without an index
// signature is closed (additionalProperties: false), so a key Grafana does not
// know is an error, while the keys Grafana's `defaultX` objects fill in may be
// absent. Prints one JSON document: {"DASHBOARD": {"release", "errors": [...]}}.

import { existsSync, readFileSync, readdirSync } from "node:fs";
import { createRequire } from "node:module";
import path from "node:path";

const [modulesDir, ...dashboards] = process.argv.slice(2);
if (!modulesDir || dashboards.length === 0) {
  console.error("usage: node validate-dashboards.mjs MODULES_DIR DASHBOARD.json...");
  process.exit(2);
}
const require = createRequire(path.join(path.resolve(modulesDir), "x.js"));
const { createGenerator } = require("ts-json-schema-generator");
const Ajv = require("ajv");

// Dashboard schemaVersion -> the pinned @grafana/schema release that writes it.
const RELEASES = { 36: "11.0.7", 39: "11.5.3", 41: "12.1.1", 42: "13.2.3" };

// The classic dashboard model's generated types and their compiled defaults in
// raw/dashboard/x; the names differ between releases (dashboard_types.gen.* in
// 11.x-12.x, types.gen.* in 13.x; .d.ts under dist/types or dist/esm, code .js or .mjs).
function modelFiles(release) {
  const root = path.join(path.resolve(modulesDir), `grafana-schema-${release}`, "dist");
  const find = (trees, pattern) => {
    for (const tree of trees) {
      const dir = path.join(root, tree, "raw", "dashboard", "x");
      const name = existsSync(dir) && readdirSync(dir).find((f) => pattern.test(f));
      if (name) return path.join(dir, name);
    }
    return null;
  };
  const types = find(["types", "esm"], /types\.gen\.d\.ts$/);
  const code = find(["esm"], /types\.gen\.m?js$/);
  if (!types || !code) {
    throw new Error(`@grafana/schema ${release} has no raw/dashboard/x types in ${root}: run scripts/setup-grafana-schema.sh`);
  }
  return { types, code };
}

async function schemaFor(release) {
  const files = modelFiles(release);
  const schema = createGenerator({
    path: files.types, type: "Dashboard", skipTypeCheck: true, expose: "export",
    topRef: true, jsDoc: "basic", additionalProperties: false,
  }).createSchema("Dashboard");
  // The module holds the defaults as plain objects and has no imports: load it from its text.
  const src = readFileSync(files.code, "utf8");
  const mod = await import("data:text/javascript," + encodeURIComponent(src));
  let relaxed = 0;
  for (const [name, def] of Object.entries(schema.definitions)) {
    const defaults = mod[`default${name}`];
    if (defaults && typeof defaults === "object" && Array.isArray(def.required)) {
      const before = def.required.length;
      def.required = def.required.filter((k) => !(k in defaults));
      relaxed += before - def.required.length;
      if (def.required.length === 0) delete def.required;
    }
  }
  panelsByType(schema);
  return { schema, relaxed };
}

// Grafana reads a panel of type "row" as a RowPanel and any other as a Panel:
// say so in the schema (instead of anyOf), so each finding names the one model
// that rejects it rather than both branches' complaints.
function panelsByType(node) {
  if (Array.isArray(node)) { node.forEach(panelsByType); return; }
  if (!node || typeof node !== "object") return;
  const refs = node.anyOf?.map((s) => s.$ref).sort().join(" ");
  if (refs === "#/definitions/Panel #/definitions/RowPanel") {
    delete node.anyOf;
    Object.assign(node, {
      if: { properties: { type: { const: "row" } }, required: ["type"] },
      then: { $ref: "#/definitions/RowPanel" }, else: { $ref: "#/definitions/Panel" },
    });
  }
  Object.values(node).forEach(panelsByType);
}

const out = {};
const cache = {};
for (const file of dashboards) {
  const doc = JSON.parse(readFileSync(file, "utf8"));
  const release = RELEASES[doc.schemaVersion];
  if (!release) {
    out[file] = { release: null, errors: [`schemaVersion ${doc.schemaVersion} has no pinned @grafana/schema release ` +
                                           `(known: ${Object.keys(RELEASES).join(", ")}); add one to tests/schema`] };
    continue;
  }
  cache[release] ??= await schemaFor(release);
  const { schema, relaxed } = cache[release];
  const ajv = new Ajv({ allErrors: true, strict: false });
  const validate = ajv.compile(schema);
  validate(doc);
  const errors = (validate.errors ?? []).filter((e) => e.keyword !== "if").map((e) => {
    const extra = e.keyword === "additionalProperties" ? ` '${e.params.additionalProperty}'` : "";
    return `${e.instancePath || "/"}: ${e.message}${extra}`;
  });
  out[file] = { release, definitions: Object.keys(schema.definitions).length, relaxed, errors: [...new Set(errors)] };
}
console.log(JSON.stringify(out, null, 1));
