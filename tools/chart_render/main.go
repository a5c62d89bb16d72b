// chart_render renders a Helm chart the way `helm template` does, with
// helm's own template engine (Go text/template + sprig), so the chart can be
// tested offline on Debian packages only (golang-go,
// golang-github-masterminds-sprig-dev, golang-gopkg-yaml.v3-dev).
//
//	chart_render --chart=deploy/helm/pdworker [--values=extra.yaml]... \
//	    [--release=pdworker] [--namespace=default] [--notes_out=NOTES] \
//	    [--values_out=values.json]
//
// It writes the manifests to stdout as a multi-document YAML stream, each
// document headed by "# Source: <chart>/templates/<file>" like helm; the
// rendered NOTES.txt and the coalesced values (for checking them against
// values.schema.json) optionally go to files. Exit status 1 and a message
// naming the template and line on any error.
//
// What it implements (what helm 3 gives a chart's templates):
//   - .Values: values.yaml coalesced with each --values file (later files
//     win, nested maps merge, a null removes a key), numbers decoded as
//     float64 exactly like helm (YAML -> JSON -> Go), so templates must
//     format big integers with `int64`, as they must under helm;
//   - .Release (Name, Namespace, Service, IsInstall, IsUpgrade, Revision),
//     .Chart (Name, Version, AppVersion, Description, Type, ...),
//     .Template (Name, BasePath), .Files (Get, GetBytes, Glob, AsConfig,
//     Lines; .helmignore'd files, templates/ and the chart's own metadata
//     files excluded), .Capabilities (a fixed Kubernetes 1.29);
//   - sprig's function map (minus env/expandenv, which helm removes) plus
//     helm's include, tpl, required, toYaml, fromYaml, toJson, fromJson,
//     lookup (always empty: there is no cluster).
//
// One deliberate difference: templates run with missingkey=error (helm
// uses missingkey=zero unless linting --strict), so a template that
// references a value absent from values.yaml fails the render instead of
// silently rendering an empty string.
//
// Build offline in GOPATH mode:
//
//	GO111MODULE=off GOPATH=/usr/share/gocode go build -o chart_render main.go
package main

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"io/ioutil"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"text/template"

	"github.com/Masterminds/sprig"
	yaml "gopkg.in/yaml.v3"
)

// multiFlag collects a repeated string flag.
type multiFlag []string

func (m *multiFlag) String() string     { return strings.Join(*m, ",") }
func (m *multiFlag) Set(v string) error { *m = append(*m, v); return nil }

// ---------------------------------------------------------------- values

// decodeYAMLAsJSON parses YAML into the types helm's values have: YAML is
// converted to JSON and decoded with encoding/json, so maps are
// map[string]interface{} and every number is a float64.
func decodeYAMLAsJSON(data []byte) (map[string]interface{}, error) {
	var raw interface{}
	if err := yaml.Unmarshal(data, &raw); err != nil {
		return nil, err
	}
	if raw == nil {
		return map[string]interface{}{}, nil
	}
	j, err := json.Marshal(jsonCompatible(raw))
	if err != nil {
		return nil, err
	}
	var out map[string]interface{}
	if err := json.Unmarshal(j, &out); err != nil {
		return nil, fmt.Errorf("top level must be a map: %v", err)
	}
	if out == nil {
		out = map[string]interface{}{}
	}
	return out, nil
}

// jsonCompatible turns yaml.v3's map[interface{}]interface{} (non-string
// keys) into map[string]interface{}, recursively.
func jsonCompatible(v interface{}) interface{} {
	switch t := v.(type) {
	case map[string]interface{}:
		for k, e := range t {
			t[k] = jsonCompatible(e)
		}
		return t
	case map[interface{}]interface{}:
		m := make(map[string]interface{}, len(t))
		for k, e := range t {
			m[fmt.Sprint(k)] = jsonCompatible(e)
		}
		return m
	case []interface{}:
		for i, e := range t {
			t[i] = jsonCompatible(e)
		}
		return t
	default:
		return v
	}
}

// coalesce merges src (a user values file) onto dst (the values so far),
// like helm: maps merge recursively, any other value replaces, and a null
// in src deletes the key.
func coalesce(dst, src map[string]interface{}) {
	for k, sv := range src {
		if sv == nil {
			delete(dst, k)
			continue
		}
		sm, srcIsMap := sv.(map[string]interface{})
		dm, dstIsMap := dst[k].(map[string]interface{})
		if srcIsMap && dstIsMap {
			coalesce(dm, sm)
			continue
		}
		dst[k] = sv
	}
}

// ----------------------------------------------------------------- files

// Files is .Files: the chart's non-template files by slash path.
type Files map[string][]byte

// Get returns a file's contents, "" when it does not exist (as helm does).
func (f Files) Get(name string) string { return string(f[name]) }

// GetBytes returns a file's contents as bytes.
func (f Files) GetBytes(name string) []byte { return f[name] }

// Glob returns the files whose path matches pattern (path.Match syntax).
func (f Files) Glob(pattern string) Files {
	out := Files{}
	for name, data := range f {
		if ok, _ := path.Match(pattern, name); ok {
			out[name] = data
		}
	}
	return out
}

// AsConfig renders the files as ConfigMap data (base name: contents).
func (f Files) AsConfig() string {
	m := map[string]string{}
	for name, data := range f {
		m[path.Base(name)] = string(data)
	}
	s, _ := toYAML(m)
	return s
}

// Lines splits a file into lines.
func (f Files) Lines(name string) []string {
	s := string(f[name])
	if s == "" {
		return []string{}
	}
	return strings.Split(strings.TrimSuffix(s, "\n"), "\n")
}

// helmIgnore is the subset of .helmignore that charts commonly use: blank
// lines and comments are skipped, a trailing "/" matches a directory, and
// patterns match the base name or the whole relative path (path.Match).
type helmIgnore []string

func loadHelmIgnore(chartDir string) helmIgnore {
	data, err := ioutil.ReadFile(filepath.Join(chartDir, ".helmignore"))
	if err != nil {
		return nil
	}
	var h helmIgnore
	for _, line := range strings.Split(string(data), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		h = append(h, line)
	}
	return h
}

func (h helmIgnore) ignored(rel string, isDir bool) bool {
	for _, p := range h {
		dirOnly := strings.HasSuffix(p, "/")
		p = strings.TrimSuffix(p, "/")
		if dirOnly && !isDir {
			continue
		}
		if ok, _ := path.Match(p, rel); ok {
			return true
		}
		if ok, _ := path.Match(p, path.Base(rel)); ok {
			return true
		}
	}
	return false
}

// ------------------------------------------------------------ functions

// toYAML marshals like helm's toYaml: sorted keys, 2-space indentation, no
// trailing newline.
func toYAML(v interface{}) (string, error) {
	var buf bytes.Buffer
	enc := yaml.NewEncoder(&buf)
	enc.SetIndent(2)
	if err := enc.Encode(v); err != nil {
		return "", err
	}
	if err := enc.Close(); err != nil {
		return "", err
	}
	return strings.TrimSuffix(buf.String(), "\n"), nil
}

// funcMap returns sprig's functions plus helm's, bound to the template set
// that include/tpl execute in.
func funcMap(root **template.Template) template.FuncMap {
	f := sprig.TxtFuncMap()
	delete(f, "env") // helm removes these: a chart must not read the
	delete(f, "expandenv")
	// environment of whoever renders it.

	const maxIncludeDepth = 1000
	depth := map[string]int{}
	f["include"] = func(name string, data interface{}) (string, error) {
		depth[name]++
		defer func() { depth[name]-- }()
		if depth[name] > maxIncludeDepth {
			return "", fmt.Errorf("include %q: recursion deeper than %d", name, maxIncludeDepth)
		}
		var buf strings.Builder
		if err := (*root).ExecuteTemplate(&buf, name, data); err != nil {
			return "", err
		}
		return buf.String(), nil
	}
	f["tpl"] = func(text string, data interface{}) (string, error) {
		clone, err := (*root).Clone()
		if err != nil {
			return "", err
		}
		t, err := clone.New("tpl").Parse(text)
		if err != nil {
			return "", fmt.Errorf("tpl: %v", err)
		}
		var buf strings.Builder
		if err := t.Execute(&buf, data); err != nil {
			return "", fmt.Errorf("tpl: %v", err)
		}
		return buf.String(), nil
	}
	f["required"] = func(message string, v interface{}) (interface{}, error) {
		if v == nil {
			return nil, fmt.Errorf("%s", message)
		}
		if s, ok := v.(string); ok && s == "" {
			return nil, fmt.Errorf("%s", message)
		}
		return v, nil
	}
	f["toYaml"] = func(v interface{}) string {
		s, err := toYAML(v)
		if err != nil {
			return "" // helm swallows the error too
		}
		return s
	}
	f["fromYaml"] = func(s string) map[string]interface{} {
		m, err := decodeYAMLAsJSON([]byte(s))
		if err != nil {
			return map[string]interface{}{"Error": err.Error()}
		}
		return m
	}
	f["toJson"] = func(v interface{}) string {
		b, err := json.Marshal(v)
		if err != nil {
			return ""
		}
		return string(b)
	}
	f["fromJson"] = func(s string) map[string]interface{} {
		m := map[string]interface{}{}
		if err := json.Unmarshal([]byte(s), &m); err != nil {
			return map[string]interface{}{"Error": err.Error()}
		}
		return m
	}
	f["lookup"] = func(apiVersion, kind, namespace, name string) (map[string]interface{}, error) {
		return map[string]interface{}{}, nil
	}
	return f
}

// -------------------------------------------------------------- capabilities

// apiVersions is .Capabilities.APIVersions: Has("group/version") or
// Has("group/version/Kind").
type apiVersions []string

func (a apiVersions) Has(v string) bool {
	for _, x := range a {
		if x == v {
			return true
		}
	}
	return false
}

// ---------------------------------------------------------------- render

// docSeparator splits a rendered template into YAML documents.
var docSeparator = regexp.MustCompile(`(?m)^---[ \t]*$`)

// isBlankDocument reports whether a document holds nothing but blank lines
// and comments.
func isBlankDocument(doc string) bool {
	for _, line := range strings.Split(doc, "\n") {
		line = strings.TrimSpace(line)
		if line != "" && !strings.HasPrefix(line, "#") {
			return false
		}
	}
	return true
}

type chartFiles struct {
	templates map[string]string // "<chart>/templates/<rel>" -> text
	files     Files
}

func loadChart(chartDir, chartName string) (*chartFiles, error) {
	ignore := loadHelmIgnore(chartDir)
	c := &chartFiles{templates: map[string]string{}, files: Files{}}
	err := filepath.Walk(chartDir, func(p string, info os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(chartDir, p)
		if err != nil || rel == "." {
			return err
		}
		rel = filepath.ToSlash(rel)
		if ignore.ignored(rel, info.IsDir()) {
			if info.IsDir() {
				return filepath.SkipDir
			}
			return nil
		}
		if info.IsDir() {
			if rel == "charts" {
				return filepath.SkipDir // subcharts are not supported
			}
			return nil
		}
		data, err := ioutil.ReadFile(p)
		if err != nil {
			return err
		}
		switch {
		case strings.HasPrefix(rel, "templates/"):
			c.templates[chartName+"/"+rel] = string(data)
		case rel == "Chart.yaml" || rel == "values.yaml" || rel == "values.schema.json" || rel == ".helmignore":
			// metadata, not .Files
		default:
			c.files[rel] = data
		}
		return nil
	})
	return c, err
}

func run() error {
	chartDir := flag.String("chart", "", "chart directory (with Chart.yaml)")
	release := flag.String("release", "pdworker", ".Release.Name")
	namespace := flag.String("namespace", "default", ".Release.Namespace")
	notesOut := flag.String("notes_out", "", "also render templates/NOTES.txt into this file")
	valuesOut := flag.String("values_out", "", "also write the coalesced values as JSON (what the templates and values.schema.json see)")
	var valueFiles multiFlag
	flag.Var(&valueFiles, "values", "values file coalesced onto values.yaml (repeatable; later wins)")
	flag.Parse()
	if *chartDir == "" {
		return fmt.Errorf("--chart is required")
	}

	// Chart.yaml -> .Chart (helm exposes the metadata with capitalised names).
	chartYAML, err := ioutil.ReadFile(filepath.Join(*chartDir, "Chart.yaml"))
	if err != nil {
		return err
	}
	meta, err := decodeYAMLAsJSON(chartYAML)
	if err != nil {
		return fmt.Errorf("Chart.yaml: %v", err)
	}
	chart := map[string]interface{}{}
	for k, v := range meta {
		chart[strings.ToUpper(k[:1])+k[1:]] = v
	}
	for _, k := range []string{"ApiVersion", "Name", "Version"} {
		if _, ok := chart[k]; !ok {
			return fmt.Errorf("Chart.yaml: missing %s", strings.ToLower(k[:1])+k[1:])
		}
	}
	for _, k := range []string{"AppVersion", "Description", "Type", "KubeVersion", "Home", "Icon", "Deprecated"} {
		if _, ok := chart[k]; !ok {
			chart[k] = ""
		}
	}
	chartName := fmt.Sprint(chart["Name"])

	// values.yaml, then each --values file on top.
	valuesYAML, err := ioutil.ReadFile(filepath.Join(*chartDir, "values.yaml"))
	if err != nil {
		return err
	}
	values, err := decodeYAMLAsJSON(valuesYAML)
	if err != nil {
		return fmt.Errorf("values.yaml: %v", err)
	}
	for _, vf := range valueFiles {
		data, err := ioutil.ReadFile(vf)
		if err != nil {
			return err
		}
		user, err := decodeYAMLAsJSON(data)
		if err != nil {
			return fmt.Errorf("%s: %v", vf, err)
		}
		coalesce(values, user)
	}

	if *valuesOut != "" {
		j, err := json.MarshalIndent(values, "", "  ")
		if err != nil {
			return err
		}
		if err := ioutil.WriteFile(*valuesOut, j, 0o644); err != nil {
			return err
		}
	}

	c, err := loadChart(*chartDir, chartName)
	if err != nil {
		return err
	}

	var root *template.Template
	root = template.New(chartName).Option("missingkey=error").Funcs(funcMap(&root))
	names := make([]string, 0, len(c.templates))
	for name := range c.templates {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		if _, err := root.New(name).Parse(c.templates[name]); err != nil {
			return err // the error names the template and line
		}
	}

	top := func(name string) map[string]interface{} {
		return map[string]interface{}{
			"Values": values,
			"Chart":  chart,
			"Files":  c.files,
			"Release": map[string]interface{}{
				"Name": *release, "Namespace": *namespace, "Service": "Helm",
				"IsInstall": true, "IsUpgrade": false, "Revision": 1,
			},
			"Capabilities": map[string]interface{}{
				"KubeVersion": map[string]interface{}{
					"Version": "v1.29.0", "Major": "1", "Minor": "29", "GitVersion": "v1.29.0",
				},
				"APIVersions": apiVersions{"v1", "apps/v1", "policy/v1"},
				"HelmVersion": map[string]interface{}{"Version": "v3.14.0"},
			},
			"Template": map[string]interface{}{
				"Name": name, "BasePath": chartName + "/templates",
			},
		}
	}

	var out strings.Builder
	for _, name := range names {
		base := path.Base(name)
		if strings.HasPrefix(base, "_") || base == "NOTES.txt" {
			continue // partials and notes are not manifests
		}
		var buf strings.Builder
		if err := root.ExecuteTemplate(&buf, name, top(name)); err != nil {
			return err
		}
		// Like helm, one "# Source" document per YAML document the template
		// produced; empty documents (whitespace or comments only) are dropped.
		for _, doc := range docSeparator.Split(buf.String(), -1) {
			if isBlankDocument(doc) {
				continue
			}
			fmt.Fprintf(&out, "---\n# Source: %s\n%s\n", name, strings.Trim(doc, "\n"))
		}
	}

	if *notesOut != "" {
		notes := chartName + "/templates/NOTES.txt"
		var buf strings.Builder
		if _, ok := c.templates[notes]; ok {
			if err := root.ExecuteTemplate(&buf, notes, top(notes)); err != nil {
				return err
			}
		}
		if err := ioutil.WriteFile(*notesOut, []byte(buf.String()), 0o644); err != nil {
			return err
		}
	}
	_, err = os.Stdout.WriteString(out.String())
	return err
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintf(os.Stderr, "chart_render: %v\n", err)
		os.Exit(1)
	}
}
