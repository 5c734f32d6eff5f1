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

{{- define "scaletrain.ckptdServiceAccountName" -}}
{{- $sa := .Values.ckptd.serviceAccount }}
{{- if $sa.create }}
{{- default (include "scaletrain.componentName" (list . "ckptd")) $sa.name }}
{{- else }}
{{- default "default" $sa.name }}
{{- end }}
{{- end }}

{{- define "scaletrain.trainerServiceAccountName" -}}
{{- include "scaletrain.componentName" (list . "trainer") }}
{{- end }}

{{/*
Pod spec fields shared by every pod: include "scaletrain.podCommon" (list . "ckptd")
*/}}
{{- define "scaletrain.podCommon" -}}
{{- $root := index . 0 }}
{{- $component := index . 1 -}}
{{- /* Trainer pods that cordon their node call the API server: their own account, its token. */}}
{{- $cordons := and (eq $component "trainer") $root.Values.trainer.cordon.markNode }}
{{- if eq $component "ckptd" }}
serviceAccountName: {{ include "scaletrain.ckptdServiceAccountName" $root }}
{{- else if $cordons }}
serviceAccountName: {{ include "scaletrain.trainerServiceAccountName" $root }}
{{- else }}
serviceAccountName: {{ include "scaletrain.serviceAccountName" $root }}
{{- end }}
automountServiceAccountToken: {{ $cordons }}
enableServiceLinks: false
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml (eq $component "postgresql" | ternary $root.Values.postgresql.podSecurityContext $root.Values.podSecurityContext) | nindent 2 }}
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

{{/*
Whether the ckptds form a cluster of the DaemonSet's pods ("true" or empty), the headless Service
they find each other through, and the --peers-dns address (that Service's FQDN and the gRPC port).
*/}}
{{- define "scaletrain.ckptdCluster" -}}
{{- $c := .Values.ckptd }}
{{- if and $c.enabled $c.cluster.enabled (eq $c.kind "DaemonSet") }}true{{ end }}
{{- end }}

{{- define "scaletrain.ckptdPeersName" -}}
{{- printf "%s-peers" (include "scaletrain.componentName" (list . "ckptd")) }}
{{- end }}

{{- define "scaletrain.ckptdPeersDns" -}}
{{- printf "%s.%s.svc.%s:%v" (include "scaletrain.ckptdPeersName" .) .Release.Namespace .Values.clusterDomain .Values.ckptd.service.port }}
{{- end }}

{{- define "scaletrain.telemetryAddress" -}}
{{- if .Values.trainer.telemetryAddress }}
{{- .Values.trainer.telemetryAddress }}
{{- else }}
{{- printf "%s:%v" (include "scaletrain.componentName" (list . "telemetry")) .Values.telemetry.service.port }}
{{- end }}
{{- end }}

{{/*
The database of telemetry and the UI: the bundled PostgreSQL, or an external one whose URL is in a
Secret. Either way the URL reaches the process in SCALETRAIN_DB_URL, never on a command line or in
a ConfigMap. For the bundled one the password comes from its Secret into SCALETRAIN_DB_PASSWORD and
Kubernetes substitutes it into the URL, so the pod spec itself holds no secret.
*/}}
{{- define "scaletrain.postgresqlName" -}}
{{- include "scaletrain.componentName" (list . "postgresql") }}
{{- end }}

{{- define "scaletrain.postgresqlSecretName" -}}
{{- default (include "scaletrain.postgresqlName" .) .Values.postgresql.auth.existingSecret }}
{{- end }}

{{- define "scaletrain.dbSecretName" -}}
{{- include "scaletrain.componentName" (list . "db") }}
{{- end }}

{{/*
Where a component's external database URL is, as (list secretName key), or empty: the UI without
read-only credentials of its own uses telemetry's.
*/}}
{{- define "scaletrain.externalDbRef" -}}
{{- $root := index . 0 }}
{{- $db := index $root.Values (index . 1) "database" }}
{{- if $db.existingSecret }}
{{- list $db.existingSecret $db.existingSecretKey | toJson }}
{{- else if $db.url }}
{{- list (include "scaletrain.dbSecretName" $root) (printf "%s-url" (index . 1)) | toJson }}
{{- end }}
{{- end }}

{{/*
The env entries that give a component its database URL: include "scaletrain.dbEnv" (list . "ui")
*/}}
{{- define "scaletrain.dbEnv" -}}
{{- $root := index . 0 }}
{{- $component := index . 1 }}
{{- $pg := $root.Values.postgresql }}
{{- if $pg.enabled }}
{{- $readOnly := eq $component "ui" -}}
- name: SCALETRAIN_DB_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "scaletrain.postgresqlSecretName" $root }}
      key: {{ ternary "readonly-password" "password" $readOnly }}
- name: SCALETRAIN_DB_URL
  value: {{ printf "postgresql+psycopg://%s:$(SCALETRAIN_DB_PASSWORD)@%s:%v/%s" (ternary $pg.auth.readOnlyUsername $pg.auth.username $readOnly) (include "scaletrain.postgresqlName" $root) $pg.port $pg.auth.database | quote }}
{{- else }}
{{- $ref := include "scaletrain.externalDbRef" (list $root $component) | default (include "scaletrain.externalDbRef" (list $root "telemetry")) | fromJsonArray -}}
- name: SCALETRAIN_DB_URL
  valueFrom:
    secretKeyRef:
      name: {{ index $ref 0 }}
      key: {{ index $ref 1 }}
{{- end }}
{{- end }}

{{/*
Whether the UI reads the database as telemetry's owner because no read-only credentials were given.
*/}}
{{- define "scaletrain.uiUsesOwnerCredentials" -}}
{{- if and (not .Values.postgresql.enabled) (not (include "scaletrain.externalDbRef" (list . "ui"))) }}true{{ end }}
{{- end }}

{{/*
The metrics container port and Service port of ckptd or telemetry: include ... .Values.ckptd.metrics
*/}}
{{- define "scaletrain.metricsPort" -}}
- name: metrics
  containerPort: {{ .port }}
  protocol: TCP
{{- end }}

{{- define "scaletrain.metricsServicePort" -}}
- name: metrics
  port: {{ .port }}
  targetPort: metrics
  protocol: TCP
{{- end }}

{{/*
Probes of a gRPC service: startup (covers migrations and loading the catalog), then liveness and
readiness, each asking the standard grpc.health.v1 service. Kubernetes' native gRPC probes speak
only plaintext; with tls.enabled each probe runs `python -m scaletrain.transport` in the pod, which
asks the same service over TLS with the pod's certificates (its client certificate for mutual TLS).
include "scaletrain.grpcProbes" (list . port)
*/}}
{{- define "scaletrain.grpcProbes" -}}
{{- $root := index . 0 }}
{{- $port := index . 1 }}
{{- $check := dict "grpc" (dict "port" $port) }}
{{- if $root.Values.tls.enabled }}
{{- $check = dict "exec" (dict "command" (list "python" "-m" "scaletrain.transport" (printf "localhost:%v" $port))) }}
{{- end -}}
startupProbe:
  {{- toYaml $check | nindent 2 }}
  periodSeconds: 5
  timeoutSeconds: 5
  failureThreshold: 60
livenessProbe:
  {{- toYaml $check | nindent 2 }}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 6
readinessProbe:
  {{- toYaml $check | nindent 2 }}
  periodSeconds: 5
  timeoutSeconds: 5
{{- end }}

{{/*
TLS (values tls) of a gRPC component: the Secret of its certificate, and its pod's volume, mount
and environment. The volume maps the Secret's keys to the names scaletrain.security.TlsFiles reads,
the certificate doubling as the client certificate. The whole directory is mounted (no subPath)
and no checksum of the Secret is put on the pod: the kubelet updates the files in place and the
servers take a renewed certificate without a restart.
include "scaletrain.tlsSecretName" (list . "ckptd")
*/}}
{{- define "scaletrain.tlsSecretName" -}}
{{- $root := index . 0 }}
{{- $component := index . 1 }}
{{- index $root.Values.tls.secretNames $component | default (include "scaletrain.componentName" (list $root (printf "%s-tls" $component))) }}
{{- end }}

{{- define "scaletrain.tlsEnv" -}}
{{- if .Values.tls.enabled -}}
- name: SCALETRAIN_TLS_DIR
  value: {{ .Values.tls.mountPath | quote }}
{{- if .Values.tls.clientAuth }}
- name: SCALETRAIN_TLS_CLIENT_AUTH
  value: "1"
{{- end }}
{{- end }}
{{- end }}

{{- define "scaletrain.tlsVolumeMount" -}}
{{- if .Values.tls.enabled -}}
- name: tls
  mountPath: {{ .Values.tls.mountPath | quote }}
  readOnly: true
{{- end }}
{{- end }}

{{- define "scaletrain.tlsVolume" -}}
{{- $root := index . 0 }}
{{- if $root.Values.tls.enabled -}}
- name: tls
  secret:
    secretName: {{ include "scaletrain.tlsSecretName" . }}
    # Readable by the pod's fsGroup only.
    defaultMode: 0440
    items:
      - key: ca.crt
        path: ca.pem
      - key: tls.crt
        path: server.pem
      - key: tls.key
        path: server.key
      - key: tls.crt
        path: client.pem
      - key: tls.key
        path: client.key
{{- end }}
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
Checks of values that the schema cannot express; templates/validate.yaml runs them on every render.
*/}}
{{- define "scaletrain.validate" -}}
{{- $t := .Values.trainer }}
{{- if $t.enabled }}
{{- $p := $t.parallel }}
{{- $world := mul $t.nodes $t.nprocPerNode }}
{{- if and (eq (int $p.dpReplicate) -1) (eq (int $p.dpShard) -1) }}
{{- fail "trainer.parallel: dpReplicate and dpShard are both -1; one at most takes the ranks the others leave (HSDP across nodes: dpReplicate -1, dpShard nprocPerNode)" }}
{{- end }}
{{- $fixed := mul $p.tp $p.pp $p.cp }}
{{- $dpReplicate := eq (int $p.dpReplicate) -1 | ternary (div $world (mul $fixed (max 1 (int $p.dpShard)))) $p.dpReplicate }}
{{- $others := mul $dpReplicate $fixed }}
{{- $dpShard := eq (int $p.dpShard) -1 | ternary (div $world $others) $p.dpShard }}
{{- if ne (mul $others $dpShard) $world }}
{{- fail (printf "trainer: the world size nodes*nprocPerNode = %v*%v = %v does not match the layout trainer.parallel dpReplicate*dpShard*tp*pp*cp = %v*%v*%v*%v*%v" $t.nodes $t.nprocPerNode $world $p.dpReplicate $p.dpShard $p.tp $p.pp $p.cp) }}
{{- end }}
{{- if gt (int $t.minNodes) (int $t.nodes) }}
{{- fail (printf "trainer.minNodes = %v must be at most trainer.nodes = %v" $t.minNodes $t.nodes) }}
{{- end }}
{{- if and (gt (int $t.minNodes) 0) (lt (int $t.minNodes) (int $t.nodes)) (ne (int $p.dpShard) -1) (ne (int $p.dpReplicate) -1) }}
{{- fail (printf "trainer.minNodes = %v needs trainer.parallel.dpShard -1 or dpReplicate -1, which absorbs the ranks a smaller job has (got dpShard %v, dpReplicate %v)" $t.minNodes $p.dpShard $p.dpReplicate) }}
{{- end }}
{{- if ne (mod (mul $dpShard $p.cp) $p.ep) 0 }}
{{- fail (printf "trainer.parallel.ep = %v must divide dpShard*cp = %v" $p.ep (mul $dpShard $p.cp)) }}
{{- end }}
{{- if and (not .Values.ckptd.enabled) (not $t.ckptdAddress) }}
{{- fail "trainer.enabled needs ckptd.enabled or trainer.ckptdAddress" }}
{{- end }}
{{- if and (not .Values.telemetry.enabled) (not $t.telemetryAddress) }}
{{- fail "trainer.enabled needs telemetry.enabled or trainer.telemetryAddress" }}
{{- end }}
{{- end }}
{{- if and .Values.ckptd.enabled .Values.ckptd.cluster.peers (ne .Values.ckptd.kind "DaemonSet") }}
{{- fail "ckptd.cluster.peers needs ckptd.kind DaemonSet: a single ckptd (Deployment) has no peers" }}
{{- end }}
{{- $c := .Values.ckptd.s3.credentials }}
{{- if and (not $c.existingSecret) (ne (empty $c.accessKeyId) (empty $c.secretAccessKey)) }}
{{- fail "ckptd.s3.credentials: set both accessKeyId and secretAccessKey, or existingSecret" }}
{{- end }}
{{- if and (not .Values.ckptd.s3.endpoint) (or $c.existingSecret $c.accessKeyId) }}
{{- fail "ckptd.s3.credentials are set but ckptd.s3.endpoint is empty: ckptd has no S3 tier without an endpoint" }}
{{- end }}
{{- $external := include "scaletrain.externalDbRef" (list . "telemetry") }}
{{- if or .Values.telemetry.enabled .Values.ui.enabled }}
{{- if and .Values.postgresql.enabled $external }}
{{- fail "telemetry.database is set but postgresql.enabled is true: set postgresql.enabled=false to use an external database" }}
{{- end }}
{{- if and (not .Values.postgresql.enabled) (not $external) }}
{{- fail "postgresql.enabled is false: set telemetry.database.url or telemetry.database.existingSecret to an external database" }}
{{- end }}
{{- end }}
{{- if .Values.tls.enabled }}
{{- range $component := list "ckptd" "telemetry" "trainer" }}
{{- if and (index $.Values $component).enabled (not (index $.Values.tls.secretNames $component)) (not $.Values.tls.certManager.issuerRef.name) }}
{{- fail (printf "tls.enabled: %s has no certificate; set tls.secretNames.%s or tls.certManager.issuerRef" $component $component) }}
{{- end }}
{{- end }}
{{- if and (include "scaletrain.ckptdCluster" .) (not .Values.ckptd.cluster.peers) }}
{{- fail "tls.enabled with ckptd.cluster: the peers found through the headless Service are dialed by pod IP, which no certificate names; list them by name in ckptd.cluster.peers, or set ckptd.cluster.enabled=false" }}
{{- end }}
{{- end }}
{{- end }}
