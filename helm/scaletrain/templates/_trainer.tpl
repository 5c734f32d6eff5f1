{{/*
The trainer's pod template, shared by the three launchers (Job, JobSet, PyTorchJob):
include "scaletrain.trainerPodTemplate" (dict "root" . "endpoint" "HOST:PORT" "container" "trainer"
  "portName" "rdzv" "subdomain" "svc-or-empty" "restartPolicy" "Never-or-empty")
Every pod runs torchrun with one process per GPU; the c10d store lives on the first pod (the
endpoint's host), which recognises its own name and hosts it.
*/}}
{{- define "scaletrain.trainerPodTemplate" -}}
{{- $root := .root }}
{{- $t := $root.Values.trainer }}
{{- $p := $t.parallel }}
{{- $runId := $t.runId | default $root.Release.Name | toString }}
{{- $resources := deepCopy $t.resources }}
{{- if $t.gpu.enabled }}
{{- $gpus := int $t.nprocPerNode }}
{{- $_ := set $resources "limits" (merge (dict $t.gpu.resourceName $gpus) ($resources.limits | default dict)) }}
{{- $_ := set $resources "requests" (merge (dict $t.gpu.resourceName $gpus) ($resources.requests | default dict)) }}
{{- end -}}
metadata:
  labels:
    {{- include "scaletrain.podLabels" (list $root "trainer") | nindent 4 }}
  {{- with $root.Values.podAnnotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  {{- include "scaletrain.podCommon" (list $root "trainer") | nindent 2 }}
  {{- with .restartPolicy }}
  restartPolicy: {{ . }}
  {{- end }}
  {{- with .subdomain }}
  subdomain: {{ . }}
  {{- end }}
  {{- with $root.Values.trainingNodes.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $root.Values.trainingNodes.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $root.Values.trainingNodes.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ .container }}
      image: {{ include "scaletrain.image" $root | quote }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      command:
        - torchrun
      args:
        - --nnodes
        - {{ $t.nodes | int64 | quote }}
        - --nproc-per-node
        - {{ $t.nprocPerNode | int64 | quote }}
        - --rdzv-backend
        - c10d
        - --rdzv-endpoint
        - {{ .endpoint | quote }}
        - --rdzv-id
        - {{ $runId | quote }}
        - --max-restarts
        - {{ $t.maxRestarts | int64 | quote }}
        - -m
        - trainer
        - --run-id
        - {{ $runId | quote }}
        - --ckptd
        - {{ include "scaletrain.ckptdAddress" $root | quote }}
        - --telemetry
        - {{ include "scaletrain.telemetryAddress" $root | quote }}
        - --steps
        - {{ $t.steps | int64 | quote }}
        - --ckpt-every
        - {{ $t.ckptEvery | int64 | quote }}
        - --dp-replicate
        - {{ $p.dpReplicate | int64 | quote }}
        - --dp-shard
        - {{ $p.dpShard | int64 | quote }}
        - --tp
        - {{ $p.tp | int64 | quote }}
        - --pp
        - {{ $p.pp | int64 | quote }}
        - --cp
        - {{ $p.cp | int64 | quote }}
        - --ep
        - {{ $p.ep | int64 | quote }}
        - --fp8
        - {{ $t.fp8.recipe | quote }}
        {{- if $t.compile }}
        - --compile
        {{- end }}
        {{- if $t.resume }}
        - --resume
        {{- end }}
        {{- range $key, $value := $t.options }}
        {{- $flag := printf "--%s" ($key | replace "_" "-") }}
        {{- if kindIs "bool" $value }}
        - {{ ternary $flag (printf "--no-%s" ($key | replace "_" "-")) $value | quote }}
        {{- else if kindIs "slice" $value }}
        {{- range $value }}
        - {{ $flag | quote }}
        - {{ . | quote }}
        {{- else }}
        - {{ $flag | quote }}
        - ""
        {{- end }}
        {{- else }}
        - {{ $flag | quote }}
        {{- if and (kindIs "float64" $value) (eq $value (floor $value)) }}
        - {{ $value | int64 | quote }}
        {{- else }}
        - {{ $value | toString | quote }}
        {{- end }}
        {{- end }}
        {{- end }}
        {{- with $t.extraArgs }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      env:
        - name: OMP_NUM_THREADS
          value: {{ $t.ompNumThreads | int64 | quote }}
        - name: HOME
          value: /tmp
        {{- with $t.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      ports:
        - name: {{ .portName }}
          containerPort: {{ $t.rdzvPort }}
          protocol: TCP
      securityContext:
        {{- toYaml $root.Values.securityContext | nindent 8 }}
      resources:
        {{- toYaml $resources | nindent 8 }}
      volumeMounts:
        {{- include "scaletrain.tmpVolumeMount" $root | nindent 8 }}
        - name: dshm
          mountPath: /dev/shm
  volumes:
    {{- include "scaletrain.tmpVolume" $root | nindent 4 }}
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $t.shmSizeLimit }}
{{- end }}

{{/*
A preempted or drained pod is replaced without counting as a failure; any other failure counts
against the launcher's limit (trainer.maxRestarts).
*/}}
{{- define "scaletrain.trainerPodFailurePolicy" -}}
podFailurePolicy:
  rules:
    - action: Ignore
      onPodConditions:
        - type: DisruptionTarget
{{- end }}
