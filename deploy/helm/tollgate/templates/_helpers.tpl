{{/* The chart's name: the app.kubernetes.io/name label of every object. */}}
{{- define "tollgate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The prefix of every object's name: the release name when it contains the
chart's name (a release called `tollgate` gives the names of the kustomize
base), else <release>-<name>. Kept short enough for <fullname>-worker-<model>.
*/}}
{{- define "tollgate.fullname" -}}
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

{{- define "tollgate.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels that select a component's pods: (dict "ctx" $ "component" "router"). */}}
{{- define "tollgate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tollgate.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
{{- with .component }}
app.kubernetes.io/component: {{ . }}
{{- end }}
{{- end }}

{{/* Every object's labels: (dict "ctx" $ "component" "router"); component may be empty. */}}
{{- define "tollgate.labels" -}}
helm.sh/chart: {{ include "tollgate.chart" .ctx }}
{{ include "tollgate.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: tollgate
{{- end }}

{{/* An image reference: (dict "ctx" $ "image" .Values.image). */}}
{{- define "tollgate.image" -}}
{{- printf "%s:%s" .image.repository (default .ctx.Chart.AppVersion .image.tag) }}
{{- end }}

{{/* The Secret a role reads: its existingSecret, or the one the chart makes. */}}
{{- define "tollgate.secretName" -}}
{{- $s := index .ctx.Values.secrets .role }}
{{- default (printf "%s-%s" (include "tollgate.fullname" .ctx) .role) $s.existingSecret }}
{{- end }}

{{/* The value of the model label (tollgate.io/model) for a model id. */}}
{{- define "tollgate.modelLabel" -}}
{{- regexReplaceAll "[^a-z0-9]+" (lower .) "-" | trunc 63 | trimAll "-" }}
{{- end }}

{{/*
The workers: a list of {model, name, deployment, label, worker} with each
model's worker settings set over workerDefaults (a key replaces the default's), as JSON (fromJson it).
None with the local backend.
*/}}
{{- define "tollgate.workers" -}}
{{- $out := list }}
{{- $seen := dict }}
{{- if eq .Values.scaler.backend "kubernetes" }}
{{- range $model, $spec := .Values.models }}
{{- /* key by key: mergeOverwrite would not let `enabled: false` or `replicas: 0` win */}}
{{- $w := deepCopy $.Values.workerDefaults }}
{{- range $key, $value := (default dict $spec.worker) }}
{{- $_ := set $w $key $value }}
{{- end }}
{{- if $w.enabled }}
{{- $slug := regexReplaceAll "[^a-z0-9]+" (lower $model) "-" | trunc 40 | trimAll "-" }}
{{- $name := default $slug $w.name }}
{{- $deployment := printf "%s-worker-%s" (include "tollgate.fullname" $) $name }}
{{- if hasKey $seen $deployment }}
{{- fail (printf "models: %s and %s both have the worker %s (set worker.name)" (get $seen $deployment) $model $deployment) }}
{{- end }}
{{- $_ := set $seen $deployment $model }}
{{- $out = append $out (dict "model" $model "name" $name "deployment" $deployment "label" (include "tollgate.modelLabel" $model) "worker" $w) }}
{{- end }}
{{- end }}
{{- end }}
{{- toJson (dict "items" $out) }}
{{- end }}

{{/* The pod security context every Tollgate pod runs with. */}}
{{- define "tollgate.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile: {type: RuntimeDefault}
{{- end }}

{{/* A container's security context: (dict "readOnlyRootFilesystem" true). */}}
{{- define "tollgate.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: {{ .readOnlyRootFilesystem }}
capabilities: {drop: [ALL]}
{{- end }}

{{/* Hashes of the settings and the catalog: a change rolls the pods. */}}
{{- define "tollgate.configChecksums" -}}
checksum/config: {{ include (print .Template.BasePath "/config.yaml") . | sha256sum }}
{{- end }}

{{/* Pod-spec fields common to every Tollgate pod: image pull secrets. */}}
{{- define "tollgate.imagePullSecrets" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Scheduling of a component: (dict "values" .Values.router). */}}
{{- define "tollgate.scheduling" -}}
{{- with .values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* The CA of the NATS servers' certificate, mounted into a container (with TLS). */}}
{{- define "tollgate.natsCaMount" -}}
{{- if .Values.nats.tls.caConfigMap }}
- {name: nats-ca, mountPath: /var/run/tollgate/nats-ca, readOnly: true}
{{- end }}
{{- end }}

{{- define "tollgate.natsCaVolume" -}}
{{- if .Values.nats.tls.caConfigMap }}
- name: nats-ca
  configMap:
    name: {{ .Values.nats.tls.caConfigMap }}
    items: [{key: {{ .Values.nats.tls.caKey }}, path: ca.crt}]
{{- end }}
{{- end }}

{{/* A role's identity on NATS: its Secret's `nkey`, and nothing else of it. */}}
{{- define "tollgate.identityVolume" -}}
- name: nats-identity
  secret:
    secretName: {{ include "tollgate.secretName" . }}
    defaultMode: 0400
    items: [{key: nkey, path: nkey}]
{{- end }}

{{/* The catalog volume. */}}
{{- define "tollgate.catalogVolume" -}}
- name: catalog
  configMap: {name: {{ include "tollgate.fullname" . }}-catalog}
{{- end }}

{{/* Volume mounts every service has. */}}
{{- define "tollgate.commonMounts" -}}
- {name: state, mountPath: /var/lib/tollgate}
- {name: catalog, mountPath: /etc/tollgate}
- {name: nats-identity, mountPath: /var/run/tollgate/nats, readOnly: true}
{{- end }}

{{/* A secretKeyRef env entry: (dict "ctx" $ "role" "router" "key" "TOLLGATE_..."). */}}
{{- define "tollgate.secretEnv" -}}
- name: {{ .key }}
  valueFrom: {secretKeyRef: {name: {{ include "tollgate.secretName" . }}, key: {{ .key }}}}
{{- end }}

{{/* The model sources' credentials, from the workers' Secret. */}}
{{- define "tollgate.modelSourceEnv" -}}
{{- range list "TOLLGATE_S3_ACCESS_KEY_ID" "TOLLGATE_S3_SECRET_ACCESS_KEY" "TOLLGATE_S3_SESSION_TOKEN" "TOLLGATE_HF_TOKEN" }}
{{ include "tollgate.secretEnv" (dict "ctx" $ "role" "worker" "key" .) }}
{{- end }}
{{- end }}
