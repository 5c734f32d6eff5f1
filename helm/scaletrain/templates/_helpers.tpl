{{/*
Chart name, truncated to the DNS label limit.
*/}}
{{- define "scaletrain.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified app name. Truncated to 45 characters so that "<fullname>-<component>" and the
trainer pods' hostnames "<fullname>-trainer-<index>" stay within 63.
*/}}
{{- define "scaletrain.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 45 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 45 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 45 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Name of a component's objects: include "scaletrain.componentName" (list . "ckptd")
*/}}
{{- define "scaletrain.componentName" -}}
{{- $root := index . 0 }}
{{- printf "%s-%s" (include "scaletrain.fullname" $root) (index . 1) }}
{{- end }}

{{- define "scaletrain.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Standard labels.
*/}}
{{- define "scaletrain.labels" -}}
helm.sh/chart: {{ include "scaletrain.chart" . }}
{{ include "scaletrain.selectorLabels" . }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: scaletrain
{{- end }}

{{/*
Selector labels.
*/}}
{{- define "scaletrain.selectorLabels" -}}
app.kubernetes.io/name: {{ include "scaletrain.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
Labels and selector labels of one component: include "scaletrain.componentLabels" (list . "ckptd")
*/}}
{{- define "scaletrain.componentLabels" -}}
{{ include "scaletrain.labels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{- define "scaletrain.componentSelectorLabels" -}}
{{ include "scaletrain.selectorLabels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{/*
Pod template labels: include "scaletrain.podLabels" (list . "ckptd")
*/}}
{{- define "scaletrain.podLabels" -}}
{{ include "scaletrain.componentLabels" . }}
{{- with (index . 0).Values.podLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "scaletrain.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "scaletrain.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "scaletrain.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion | toString) }}
{{- end }}

{{/*
Pod spec fields shared by every pod.
*/}}
{{- define "scaletrain.podCommon" -}}
serviceAccountName: {{ include "scaletrain.serviceAccountName" . }}
automountServiceAccountToken: false
enableServiceLinks: false
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end }}

{{/*
The /tmp volume of every pod, and its mount.
*/}}
{{- define "scaletrain.tmpVolume" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.tmpSizeLimit }}
{{- end }}

{{- define "scaletrain.tmpVolumeMount" -}}
- name: tmp
  mountPath: /tmp
{{- end }}

{{/*
Addresses (HOST:PORT) of the services, as the other components dial them.
*/}}
{{- define "scaletrain.ckptdAddress" -}}
{{- if .Values.trainer.ckptdAddress }}
{{- .Values.trainer.ckptdAddress }}
{{- else }}
{{- printf "%s:%v" (include "scaletrain.componentName" (list . "ckptd")) .Values.ckptd.service.port }}
{{- end }}
{{- end }}

{{- define "scaletrain.telemetryAddress" -}}
{{- if .Values.trainer.telemetryAddress }}
{{- .Values.trainer.telemetryAddress }}
{{- else }}
{{- printf "%s:%v" (include "scaletrain.componentName" (list . "telemetry")) .Values.telemetry.service.port }}
{{- end }}
{{- end }}

{{/*
Telemetry database: external (URL in a Secret) or SQLite on a PVC.
*/}}
{{- define "scaletrain.externalDatabase" -}}
{{- if or .Values.telemetry.database.url .Values.telemetry.database.existingSecret }}true{{ end }}
{{- end }}

{{- define "scaletrain.dbSecretName" -}}
{{- default (include "scaletrain.componentName" (list . "db")) .Values.telemetry.database.existingSecret }}
{{- end }}

{{- define "scaletrain.dbSecretKey" -}}
{{- if .Values.telemetry.database.existingSecret }}
{{- .Values.telemetry.database.existingSecretKey }}
{{- else }}
{{- "SCALETRAIN_DB_URL" }}
{{- end }}
{{- end }}

{{- define "scaletrain.sqliteClaimName" -}}
{{- default (include "scaletrain.componentName" (list . "telemetry")) .Values.telemetry.persistence.existingClaim }}
{{- end }}

{{- define "scaletrain.sqliteUrl" -}}
{{- printf "sqlite:///%s/telemetry.db" (trimSuffix "/" .Values.telemetry.persistence.mountPath) }}
{{- end }}

{{/*
The database of telemetry and ui: "--db URL" arguments for SQLite; for an external database the
URL comes from the SCALETRAIN_DB_URL variable (scaletrain.dbEnv). Include only in that case.
*/}}
{{- define "scaletrain.dbArgs" -}}
{{- if not (include "scaletrain.externalDatabase" .) -}}
- --db
- {{ include "scaletrain.sqliteUrl" . | quote }}
{{- end }}
{{- end }}

{{- define "scaletrain.dbEnv" -}}
{{- if include "scaletrain.externalDatabase" . -}}
- name: SCALETRAIN_DB_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "scaletrain.dbSecretName" . }}
      key: {{ include "scaletrain.dbSecretKey" . }}
{{- end }}
{{- end }}

{{- define "scaletrain.sqliteVolume" -}}
- name: telemetry-db
  persistentVolumeClaim:
    claimName: {{ include "scaletrain.sqliteClaimName" . }}
{{- end }}

{{- define "scaletrain.sqliteVolumeMount" -}}
- name: telemetry-db
  mountPath: {{ .Values.telemetry.persistence.mountPath | quote }}
{{- end }}

{{/*
S3 credentials: the Secret's name, or nothing when no credentials are configured.
*/}}
{{- define "scaletrain.s3SecretName" -}}
{{- $c := .Values.ckptd.s3.credentials }}
{{- if $c.existingSecret }}
{{- $c.existingSecret }}
{{- else if or $c.accessKeyId $c.secretAccessKey }}
{{- include "scaletrain.componentName" (list . "s3") }}
{{- end }}
{{- end }}

{{/*
Checks of values that the schema cannot express; included by every template that depends on them.
*/}}
{{- define "scaletrain.validate" -}}
{{- $t := .Values.trainer }}
{{- if $t.enabled }}
{{- if lt (int $t.nodes) 1 }}
{{- fail (printf "trainer.nodes must be at least 1 (got %v)" $t.nodes) }}
{{- end }}
{{- if lt (int $t.nprocPerNode) 1 }}
{{- fail (printf "trainer.nprocPerNode must be at least 1 (got %v)" $t.nprocPerNode) }}
{{- end }}
{{- if and (not .Values.ckptd.enabled) (not $t.ckptdAddress) }}
{{- fail "trainer.enabled needs ckptd.enabled or trainer.ckptdAddress" }}
{{- end }}
{{- if and (not .Values.telemetry.enabled) (not $t.telemetryAddress) }}
{{- fail "trainer.enabled needs telemetry.enabled or trainer.telemetryAddress" }}
{{- end }}
{{- end }}
{{- $c := .Values.ckptd.s3.credentials }}
{{- if and (not $c.existingSecret) (ne (empty $c.accessKeyId) (empty $c.secretAccessKey)) }}
{{- fail "ckptd.s3.credentials: set both accessKeyId and secretAccessKey, or existingSecret" }}
{{- end }}
{{- if and (not .Values.ckptd.s3.endpoint) (or $c.existingSecret $c.accessKeyId) }}
{{- fail "ckptd.s3.credentials are set but ckptd.s3.endpoint is empty: ckptd has no S3 tier without an endpoint" }}
{{- end }}
{{- if and .Values.telemetry.enabled (not (include "scaletrain.externalDatabase" .)) (gt (int .Values.telemetry.replicas) 1) }}
{{- fail "telemetry.replicas > 1 needs an external database (telemetry.database.url or existingSecret): SQLite has a single writer" }}
{{- end }}
{{- if and .Values.ui.enabled (not (include "scaletrain.externalDatabase" .)) (not .Values.telemetry.enabled) }}
{{- fail "ui.enabled without telemetry.enabled needs an external database (telemetry.database.url or existingSecret)" }}
{{- end }}
{{- end }}
