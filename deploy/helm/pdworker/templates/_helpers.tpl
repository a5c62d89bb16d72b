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
