{{/* Names, labels and the derived settings every template shares. */}}

{{- define "dispatch.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's base name; component names append -dispatcher etc. */}}
{{- define "dispatch.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "dispatch.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "dispatch.labels" -}}
helm.sh/chart: {{ include "dispatch.chart" . }}
app.kubernetes.io/name: {{ include "dispatch.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Selector labels of one component: call with (list $ "dispatcher"). */}}
{{- define "dispatch.selectorLabels" -}}
{{- $ := index . 0 -}}
app.kubernetes.io/name: {{ include "dispatch.name" $ }}
app.kubernetes.io/instance: {{ $.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{- define "dispatch.componentLabels" -}}
{{- $ := index . 0 -}}
{{ include "dispatch.labels" $ }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{- define "dispatch.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "dispatch.dispatcher.name" -}}
{{- printf "%s-dispatcher" (include "dispatch.fullname" .) }}
{{- end }}

{{/* The headless Service giving each replica a stable DNS name. */}}
{{- define "dispatch.dispatcher.headless" -}}
{{- printf "%s-dispatcher-hl" (include "dispatch.fullname" .) }}
{{- end }}

{{- define "dispatch.agent.name" -}}
{{- printf "%s-agent" (include "dispatch.fullname" .) }}
{{- end }}

{{- define "dispatch.relay.name" -}}
{{- printf "%s-relay" (include "dispatch.fullname" .) }}
{{- end }}

{{/* The relay Service's URL: what agents are given when relay.enabled. */}}
{{- define "dispatch.relay.url" -}}
{{- printf "%s://%s.%s.svc:%d" (include "dispatch.scheme" .) (include "dispatch.relay.name" .) .Release.Namespace (int .Values.relay.grpcPort) }}
{{- end }}

{{- define "dispatch.etcd.name" -}}
{{- printf "%s-etcd" (include "dispatch.fullname" .) }}
{{- end }}

{{- define "dispatch.dispatcher.serviceAccount" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "dispatch.dispatcher.name" .) .Values.serviceAccount.dispatcherName }}
{{- else }}
{{- default "default" .Values.serviceAccount.dispatcherName }}
{{- end }}
{{- end }}

{{- define "dispatch.agent.serviceAccount" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "dispatch.agent.name" .) .Values.serviceAccount.agentName }}
{{- else }}
{{- default "default" .Values.serviceAccount.agentName }}
{{- end }}
{{- end }}

{{- define "dispatch.scheme" -}}
{{- if .Values.tls.enabled }}https{{ else }}http{{ end }}
{{- end }}

{{/* "true" when the dispatcher keeps its state in etcd. */}}
{{- define "dispatch.useEtcd" -}}
{{- if or .Values.etcd.endpoints .Values.etcd.bundled.enabled }}true{{ end }}
{{- end }}

{{/* The etcd endpoints, comma separated: the given ones, else the bundled StatefulSet's pods. */}}
{{- define "dispatch.etcd.endpoints" -}}
{{- if .Values.etcd.endpoints }}
{{- join "," .Values.etcd.endpoints }}
{{- else if .Values.etcd.bundled.enabled }}
{{- $name := include "dispatch.etcd.name" . }}
{{- $urls := list }}
{{- range $i := until (int .Values.etcd.bundled.replicas) }}
{{- $urls = append $urls (printf "http://%s-%d.%s-hl.%s.svc:%d" $name $i $name $.Release.Namespace (int $.Values.etcd.bundled.clientPort)) }}
{{- end }}
{{- join "," $urls }}
{{- end }}
{{- end }}

{{/* Every replica's own URL, comma separated: what agents are given, and each replica's --advertise-url. */}}
{{- define "dispatch.dispatcher.urls" -}}
{{- $name := include "dispatch.dispatcher.name" . }}
{{- $hl := include "dispatch.dispatcher.headless" . }}
{{- $urls := list }}
{{- range $i := until (int .Values.dispatcher.replicas) }}
{{- $urls = append $urls (printf "%s://%s-%d.%s.%s.svc:%d" (include "dispatch.scheme" $) $name $i $hl $.Release.Namespace (int $.Values.dispatcher.grpcPort)) }}
{{- end }}
{{- join "," $urls }}
{{- end }}

{{/* Checks the schema cannot express; fails the render with a message naming the value. */}}
{{- define "dispatch.validate" -}}
{{- if and (gt (int .Values.dispatcher.replicas) 1) (not (include "dispatch.useEtcd" .)) }}
{{- fail "dispatcher.replicas > 1 needs etcd: set etcd.endpoints or etcd.bundled.enabled=true (the embedded store belongs to one replica)" }}
{{- end }}
{{- if and .Values.tls.enabled (not .Values.tls.secretName) }}
{{- fail "tls.enabled=true needs tls.secretName (a Secret with ca.crt, tls.crt and tls.key)" }}
{{- end }}
{{- if and (eq .Values.agent.onShutdown "leave") (not .Values.agent.hostPID) }}
{{- fail "agent.onShutdown=leave needs agent.hostPID=true: jobs die with the agent container's PID namespace otherwise" }}
{{- end }}
{{- if and .Values.relay.enabled .Values.tls.enabled .Values.tls.requireClientCerts (not .Values.relay.clientSecretName) }}
{{- fail "relay.enabled with tls.requireClientCerts needs relay.clientSecretName (the relay's client certificate naming its nodes, from dispatcher gen-certs --relay R --relay-node ...)" }}
{{- end }}
{{- if and .Values.etcd.bundled.enabled (eq (mod (int .Values.etcd.bundled.replicas) 2) 0) }}
{{- fail "etcd.bundled.replicas must be odd (1, 3, 5) to keep a quorum" }}
{{- end }}
{{- end }}
