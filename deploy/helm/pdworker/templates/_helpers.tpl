{{/*
Names and labels shared by every template.

Role-scoped helpers take a dict: (dict "root" $ "role" "prefill").
*/}}

{{/* Chart name, overridable (app.kubernetes.io/name). */}}
{{- define "pdworker.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name: <release>-<chart>, or the release name alone when it already
contains the chart name. Truncated so "<fullname>-<role>-<suffix>" stays a
valid DNS label.
*/}}
{{- define "pdworker.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 48 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 48 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 48 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* <fullname>-<role>: the Deployment, Service and PDB of one role. */}}
{{- define "pdworker.roleFullname" -}}
{{- printf "%s-%s" (include "pdworker.fullname" .root) .role }}
{{- end }}

{{/* helm.sh/chart label value. */}}
{{- define "pdworker.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels of the whole release (both roles). Never change them:
Deployment selectors are immutable. */}}
{{- define "pdworker.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdworker.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Standard labels on every resource. */}}
{{- define "pdworker.labels" -}}
helm.sh/chart: {{ include "pdworker.chart" . }}
{{ include "pdworker.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pdworker
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector labels of one role's pods: the release's plus the role. */}}
{{- define "pdworker.roleSelectorLabels" -}}
{{ include "pdworker.selectorLabels" .root }}
app.kubernetes.io/component: {{ .role }}
{{- end }}

{{/* Standard labels of one role's resources. */}}
{{- define "pdworker.roleLabels" -}}
{{ include "pdworker.labels" .root }}
app.kubernetes.io/component: {{ .role }}
{{- end }}

{{/* ServiceAccount name. */}}
{{- define "pdworker.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pdworker.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Container image reference. */}}
{{- define "pdworker.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* ConfigMap holding every role's compilation config. */}}
{{- define "pdworker.configMapName" -}}
{{- printf "%s-compilation-config" (include "pdworker.fullname" .) }}
{{- end }}

{{/*
A probe on the gRPC port. Native gRPC health (grpc.health.v1) when the port
speaks plaintext; kubelet's gRPC probe has no TLS, so with tls.enabled it
degrades to a TCP connect (see README "Deploy").
Args: (dict "root" $ "probe" .Values.probes.startup)
*/}}
{{- define "pdworker.probe" -}}
{{- if .root.Values.tls.enabled -}}
tcpSocket:
  port: grpc
{{- else -}}
grpc:
  port: {{ .root.Values.ports.grpc }}
{{- end }}
periodSeconds: {{ .probe.periodSeconds }}
timeoutSeconds: {{ .probe.timeoutSeconds }}
failureThreshold: {{ .probe.failureThreshold }}
{{- end }}

{{/*
Labels of one role's pods: the role's standard labels, llm-d's labels
(llmd.labels) and the role's podLabels. The InferencePool selector and the
Deployment selector both pick from these.
Args: (dict "root" $ "role" "decode")
*/}}
{{- define "pdworker.podLabels" -}}
{{ include "pdworker.roleLabels" . }}
{{- $llmd := .root.Values.llmd.labels }}
{{- if $llmd.enabled }}
{{ $llmd.roleKey }}: {{ .role | quote }}
{{ $llmd.engineTypeKey }}: {{ $llmd.engineType | quote }}
{{- range $k, $v := $llmd.extra }}
{{ $k }}: {{ $v | quote }}
{{- end }}
{{- end }}
{{- with (index .root.Values.roles .role).podLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
PromQL label matchers selecting one role's worker pods as Prometheus Operator
labels them (namespace, pod): Deployment pods are <deployment>-<hash>-<id>.
Args: (dict "root" $ "role" "decode")
*/}}
{{- define "pdworker.promSelector" -}}
{{- printf "namespace=%q,pod=~%q" .root.Release.Namespace (printf "%s-[a-z0-9]+-[a-z0-9]+" (include "pdworker.roleFullname" .)) }}
{{- end }}

{{/*
The role's KEDA query: roles.<role>.autoscaling.keda.query with
{{ .selector }} replaced by pdworker.promSelector.
Args: (dict "root" $ "role" "decode")
*/}}
{{- define "pdworker.kedaQuery" -}}
{{- $query := required (printf "roles.%s.autoscaling.keda.query is required for mode keda" .role) (index .root.Values.roles .role).autoscaling.keda.query }}
{{- tpl $query (dict "selector" (include "pdworker.promSelector" .) "Template" .root.Template) }}
{{- end }}

{{/*
The preStop command: start the worker's drain (SIGTERM to PID 1, the
worker; see values.yaml "preStop") and return only once it has exited.
*/}}
{{- define "pdworker.preStopScript" -}}
{{- if gt (int64 .Values.preStop.delaySeconds) 0 }}sleep {{ int64 .Values.preStop.delaySeconds }}; {{ end -}}
kill -TERM 1; while kill -0 1 2>/dev/null; do sleep 1; done
{{- end }}

{{/* Router (SMG) resource names and labels. */}}
{{- define "pdworker.routerFullname" -}}
{{- printf "%s-router" (include "pdworker.fullname" .) }}
{{- end }}

{{- define "pdworker.routerSelectorLabels" -}}
{{ include "pdworker.selectorLabels" . }}
app.kubernetes.io/component: router
{{- end }}

{{- define "pdworker.routerLabels" -}}
{{ include "pdworker.labels" . }}
app.kubernetes.io/component: router
{{- end }}

{{/* A role's label selector as "k=v,k=v" (SMG --selector syntax). */}}
{{- define "pdworker.roleSelectorString" -}}
{{- $labels := include "pdworker.roleSelectorLabels" . | fromYaml }}
{{- $pairs := list }}
{{- range $k := keys $labels | sortAlpha }}
{{- $pairs = append $pairs (printf "%s=%s" $k (index $labels $k)) }}
{{- end }}
{{- join "," $pairs }}
{{- end }}
