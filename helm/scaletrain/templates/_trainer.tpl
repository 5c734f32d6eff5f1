{{/*
The rendezvous: its Deployment and Service, and the endpoint (FQDN:port) torchrun's agents dial.
*/}}
{{- define "scaletrain.rendezvousName" -}}
{{- include "scaletrain.componentName" (list . "rendezvous") }}
{{- end }}

{{- define "scaletrain.rendezvousEndpoint" -}}
{{- printf "%s.%s.svc.%s:%v" (include "scaletrain.rendezvousName" .) .Release.Namespace .Values.clusterDomain .Values.trainer.rdzvPort }}
{{- end }}

{{/*
The trainer's pod template, shared by the three launchers (Job, JobSet, PyTorchJob):
include "scaletrain.trainerPodTemplate" (dict "root" . "container" "trainer"
  "restartPolicy" "Never-or-empty" "job" true-for-the-pods-of-a-Job)
Every pod, spares included, runs a torchrun agent with one process per GPU. The agents meet in the
rendezvous' store as clients (is_host=false): none hosts it, so no training pod is one the job
cannot lose, and the first trainer.nodes agents of a round train while the others wait as spares.
*/}}
{{- define "scaletrain.trainerPodTemplate" -}}
{{- $root := .root }}
{{- $t := $root.Values.trainer }}
{{- $p := $t.parallel }}
{{- $runId := $t.runId | default $root.Release.Name | toString }}
{{- $elastic := and (gt (int $t.minNodes) 0) (lt (int $t.minNodes) (int $t.nodes)) }}
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
      # torchrun, less torch 2.13's crash when the job ends while an agent still waits as a
      # spare: an unused spare exits 0, so an Indexed Job whose spares were never needed completes.
      # It forks the ranks from a process that imported the trainer as the pod started (warm).
      command:
        - python
        - -m
        - scaletrain.app.agent
      args:
        {{- if $t.cordon.after }}
        # The agent's own option, before torchrun's: the pod leaves after this many failures in a row.
        - --cordon-after
        - {{ $t.cordon.after | int64 | quote }}
        {{- end }}
        # Spares or not, a round is trainer.nodes agents: the others wait in its redundancy list.
        - --nnodes
        {{- if $elastic }}
        # Elastic: a round forms with minNodes pods once its last call (2 s) found no more.
        - {{ printf "%d:%d" (int $t.minNodes) (int $t.nodes) | quote }}
        {{- else }}
        - {{ $t.nodes | int64 | quote }}
        {{- end }}
        - --nproc-per-node
        - {{ $t.nprocPerNode | int64 | quote }}
        - --rdzv-backend
        - c10d
        - --rdzv-endpoint
        - {{ include "scaletrain.rendezvousEndpoint" $root | quote }}
        - --rdzv-conf
        # Elastic: fewer than minNodes pods left, the others wait capacityWaitS for pods to join.
        - {{ printf "is_host=false,keep_alive_interval=%d,keep_alive_max_attempt=3%s" ($t.keepAliveS | int) ($elastic | ternary (printf ",last_call_timeout=2,join_timeout=%d" ($t.capacityWaitS | int)) "") | quote }}
        - --rdzv-id
        {{- if .job }}
        # One rendezvous per Job: the store outlives the Job, and torch closes a rendezvous for good
        # when its agents end, so a Job created again for the run (to resume it) would find it closed.
        - {{ printf "%s-$(JOB_UID)" $runId | quote }}
        {{- else }}
        - {{ $runId | quote }}
        {{- end }}
        # The address rank 0's agent publishes for its ranks' store: the pod IP, which every pod
        # reaches without DNS (a pod's own hostname does not resolve from the others).
        - --local-addr
        - $(POD_IP)
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
        - name: POD_IP
          valueFrom:
            fieldRef:
              fieldPath: status.podIP
        {{- if $elastic }}
        # The ranks at the full size: on fewer pods each rank keeps its micro-batch.
        - name: SCALETRAIN_FULL_WORLD
          value: {{ mul $t.nodes $t.nprocPerNode | int64 | quote }}
        {{- end }}
        # The node a cordoned pod marks unschedulable (trainer.cordon.markNode).
        - name: NODE_NAME
          valueFrom:
            fieldRef:
              fieldPath: spec.nodeName
        {{- if .job }}
        # The same for every pod of the Job and its replacements, new for each Job.
        - name: JOB_UID
          valueFrom:
            fieldRef:
              fieldPath: metadata.labels['batch.kubernetes.io/controller-uid']
        {{- end }}
        # A fresh store for the ranks in every round, announced to every agent of that round:
        # shared (torch's default), rank 0's agent tells only the agents of its first round where
        # it is, and an agent that joins later (a spare taking over, a replaced pod) waits forever.
        - name: TORCH_DISABLE_SHARE_RDZV_TCP_STORE
          value: "1"
        {{- with include "scaletrain.tlsEnv" $root }}{{ . | nindent 8 }}{{ end }}
        {{- with $t.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      securityContext:
        {{- toYaml $root.Values.securityContext | nindent 8 }}
      resources:
        {{- toYaml $resources | nindent 8 }}
      volumeMounts:
        {{- include "scaletrain.tmpVolumeMount" $root | nindent 8 }}
        {{- with include "scaletrain.tlsVolumeMount" $root }}{{ . | nindent 8 }}{{ end }}
        - name: dshm
          mountPath: /dev/shm
  volumes:
    {{- include "scaletrain.tmpVolume" $root | nindent 4 }}
    {{- with include "scaletrain.tlsVolume" (list $root "trainer") }}{{ . | nindent 4 }}{{ end }}
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $t.shmSizeLimit }}
{{- end }}

{{/*
A preempted or drained pod, or one that cordoned itself, is replaced without counting as a
failure; any other failure counts against the launcher's limit (trainer.maxRestarts).
*/}}
{{- define "scaletrain.trainerPodFailurePolicy" -}}
podFailurePolicy:
  rules:
    - action: Ignore
      onPodConditions:
        - type: DisruptionTarget
    # A pod that left because its ranks kept failing (trainer.cordon): its node failed, not the
    # job; it is replaced (elsewhere, once its node is cordoned) without counting.
    - action: Ignore
      onExitCodes:
        containerName: trainer
        operator: In
        values: [72]
{{- end }}
