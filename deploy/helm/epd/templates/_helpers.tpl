{{/* vim: set filetype=mustache: */}}

{{- define "epd.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Release-wide base name. Kept to 44 characters so that "<base>-encoder-headless" and the StatefulSet
pods' controller-revision-hash label ("<base>-encoder-<10 chars>") stay within 63.
*/}}
{{- define "epd.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 44 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 44 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 44 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "epd.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Name of one tier's objects: dict "root" $ "tier" "encoder" */}}
{{- define "epd.tierName" -}}
{{- printf "%s-%s" (include "epd.fullname" .root) .tier -}}
{{- end -}}

{{- define "epd.headlessName" -}}
{{- printf "%s-%s-headless" (include "epd.fullname" .root) .tier -}}
{{- end -}}

{{- define "epd.configMapName" -}}
{{- printf "%s-config" (include "epd.fullname" .) -}}
{{- end -}}

{{- define "epd.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "epd.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "epd.labels" -}}
helm.sh/chart: {{ include "epd.chart" . }}
app.kubernetes.io/name: {{ include "epd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: epd
{{- end -}}

{{/* dict "root" $ "tier" "encoder" */}}
{{- define "epd.tierLabels" -}}
{{ include "epd.labels" .root }}
app.kubernetes.io/component: {{ .tier }}
{{- end -}}

{{- define "epd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "epd.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .tier }}
{{- end -}}

{{/* The image of a tier: dict "root" $ "tier" "encoder" */}}
{{- define "epd.image" -}}
{{- $root := .root -}}
{{- $own := (index $root.Values .tier).image | default dict -}}
{{- $repo := $own.repository | default $root.Values.image.repository -}}
{{- $flavor := ternary "cuda" "cpu" $root.Values.gpu.enabled -}}
{{- $tag := $own.tag | default $root.Values.image.tag | default (printf "%s-%s" $root.Chart.AppVersion $flavor) -}}
{{- printf "%s:%s" $repo $tag -}}
{{- end -}}

{{- define "epd.imagePullPolicy" -}}
{{- $own := (index .root.Values .tier).image | default dict -}}
{{- $own.pullPolicy | default .root.Values.image.pullPolicy -}}
{{- end -}}

{{/* What the tiers pass as `model`: a preset name or the mounted checkpoint directory. */}}
{{- define "epd.modelRef" -}}
{{- if eq .Values.model.source "preset" -}}
{{- required "model.preset is required when model.source=preset" .Values.model.preset -}}
{{- else -}}
{{- required "model.path is required" .Values.model.path -}}
{{- end -}}
{{- end -}}

{{/* Number of addresses the router is given for a tier. */}}
{{- define "epd.tierSlots" -}}
{{- $t := index .root.Values .tier -}}
{{- if $t.autoscaling.enabled -}}{{ $t.autoscaling.maxReplicas }}{{- else if $t.keda.enabled -}}{{ $t.keda.maxReplicas }}{{- else -}}{{ $t.replicas }}{{- end -}}
{{- end -}}

{{/* Comma-separated stable addresses of a tier's pods: dict "root" $ "tier" "encoder" */}}
{{- define "epd.workerAddresses" -}}
{{- $root := .root -}}
{{- $tier := .tier -}}
{{- $sts := include "epd.tierName" . -}}
{{- $svc := include "epd.headlessName" . -}}
{{- $addrs := list -}}
{{- range $i := until (int (include "epd.tierSlots" .)) -}}
{{- $addrs = append $addrs (printf "%s-%d.%s.%s.svc.%s:%d" $sts $i $svc $root.Release.Namespace $root.Values.clusterDomain (int $root.Values.workerPorts.grpc)) -}}
{{- end -}}
{{- join "," $addrs -}}
{{- end -}}

{{/* A tier's headless Service as host:port, whose DNS answers are its pods (router discovery: dns). */}}
{{- define "epd.serviceAddress" -}}
{{- printf "%s.%s.svc.%s:%d" (include "epd.headlessName" .) .root.Release.Namespace .root.Values.clusterDomain (int .root.Values.workerPorts.grpc) -}}
{{- end -}}

{{/* Tensor-parallel ranks of each worker of a tier: its engine's tensor_parallel_size (the tier's
config over workerConfig); an encoder is never cut. */}}
{{- define "epd.ranks" -}}
{{- $t := index .root.Values .tier -}}
{{- $cfg := mustMergeOverwrite (dict) (deepCopy (.root.Values.workerConfig | default dict)) (deepCopy ($t.config | default dict)) -}}
{{- if eq .tier "encoder" -}}1{{- else -}}{{ (get $cfg "engine" | default dict).tensor_parallel_size | default 1 }}{{- end -}}
{{- end -}}

{{/* GPUs per pod of a worker tier (0 when gpu.enabled is false): gpus (or gpu.count) per rank, and a
tensor-parallel worker's ranks are processes of its one pod, so the pod holds every rank's GPUs. */}}
{{- define "epd.gpus" -}}
{{- $t := index .root.Values .tier -}}
{{- if .root.Values.gpu.enabled -}}
{{- $perRank := ternary $t.gpus .root.Values.gpu.count (hasKey $t "gpus") -}}
{{- mul (int $perRank) (int (include "epd.ranks" .)) -}}
{{- else -}}0{{- end -}}
{{- end -}}

{{/*
The YAML a worker tier reads with --config: chart-managed fields, then workerConfig, then the tier's
own config (deep-merged), with CUDA devices filled in when gpu.enabled and the tier has GPUs.
*/}}
{{- define "epd.workerConfig" -}}
{{- $root := .root -}}
{{- $tier := .tier -}}
{{- $t := index $root.Values $tier -}}
{{- $cfg := mustMergeOverwrite (dict) (deepCopy ($root.Values.workerConfig | default dict)) (deepCopy ($t.config | default dict)) -}}
{{- if gt (int (include "epd.gpus" .)) 0 -}}
{{- if eq $tier "encoder" -}}
{{- $enc := mustMergeOverwrite (dict "device" "cuda" "dtype" $root.Values.gpu.dtype) (get $cfg "encoder" | default dict) -}}
{{- $_ := set $cfg "encoder" $enc -}}
{{- else -}}
{{- $eng := mustMergeOverwrite (dict "device" "cuda" "dtype" $root.Values.gpu.dtype) (get $cfg "engine" | default dict) -}}
{{- $_ := set $cfg "engine" $eng -}}
{{- end -}}
{{- end -}}
{{- if and (hasKey $cfg "encoder") (ne $tier "encoder") -}}
{{- $_ := unset $cfg "encoder" -}}
{{- end -}}
{{- /* encoders read and write the encoder cache store; prefill reads rows from it (store handles) */ -}}
{{- if and (has $tier (list "encoder" "prefill")) $root.Values.encoderCacheStore.enabled -}}
{{- $store := dict "encoder_cache_store" "mooncake" "mooncake_master" (include "epd.mooncakeMaster" $root) -}}
{{- $_ := set $cfg "encoder" (mustMergeOverwrite (get $cfg "encoder" | default dict) $store) -}}
{{- end -}}
{{- if and (hasKey $cfg "engine") (empty (get $cfg "engine")) -}}
{{- $_ := unset $cfg "engine" -}}
{{- end -}}
{{- if and (hasKey $cfg "encoder") (empty (get $cfg "encoder")) -}}
{{- $_ := unset $cfg "encoder" -}}
{{- end -}}
{{- $managed := dict "model" (include "epd.modelRef" $root) "host" "0.0.0.0" "port" (int $root.Values.workerPorts.grpc) "metrics_port" (int $root.Values.workerPorts.metrics) "transport" $root.Values.transport -}}
{{- if eq $tier "decode" }}{{ $_ := set $managed "stream_port" (int $root.Values.workerPorts.stream) }}{{ end -}}
{{- /* the router's public name(s): the workers' metrics carry the same model_name label */ -}}
{{- with (get ($root.Values.router.config | default dict) "served_model_name") }}{{ $_ := set $managed "served_model_name" . }}{{ end -}}
{{- with (include "epd.tlsConfig" $root | fromYaml) }}{{ $_ := set $managed "tls" . }}{{ end -}}
{{- toYaml (mustMergeOverwrite $cfg $managed) -}}
{{- end -}}

{{- define "epd.routerConfig" -}}
{{- $cfg := deepCopy (.Values.router.config | default dict) -}}
{{- $managed := dict "model" (include "epd.modelRef" .) "transport" .Values.transport -}}
{{- with (include "epd.tlsConfig" . | fromYaml) }}{{ $_ := set $managed "tls" . }}{{ end -}}
{{- if .Values.apiKeys.secretName }}{{ $_ := set $managed "api_key_file" (printf "%s/%s" (include "epd.apiKeysDir" .) .Values.apiKeys.key) }}{{ end -}}
{{- toYaml (mustMergeOverwrite $cfg $managed) -}}
{{- end -}}

{{/* TlsConfig of every process (empty when tls is off): the mounted Secret's files. */}}
{{- define "epd.tlsConfig" -}}
{{- if .Values.tls.enabled -}}
{{- $dir := include "epd.tlsDir" . -}}
tls_cert: {{ printf "%s/tls.crt" $dir }}
tls_key: {{ printf "%s/tls.key" $dir }}
tls_ca: {{ printf "%s/ca.crt" $dir }}
{{- with .Values.tls.serverName }}
tls_server_name: {{ . | quote }}
{{- end }}
{{- end -}}
{{- end -}}

{{- define "epd.tlsDir" -}}/var/run/secrets/epd/tls{{- end -}}
{{- define "epd.apiKeysDir" -}}/var/run/secrets/epd/api-keys{{- end -}}

{{/* Checks the schema cannot express. */}}
{{- define "epd.validate" -}}
{{- if and (has .Values.transport (list "nccl" "cuda_ipc")) (not .Values.gpu.enabled) -}}
{{- fail (printf "transport=%s moves CUDA tensors: set gpu.enabled=true (or use transport=inline)" .Values.transport) -}}
{{- end -}}
{{- if and (ne .Values.model.source "preset") (not (hasPrefix "/" (.Values.model.path | toString))) -}}
{{- fail "model.path must be an absolute path in the container" -}}
{{- end -}}
{{- if and .Values.tls.enabled (eq .Values.router.discovery "dns") (not .Values.tls.serverName) -}}
{{- fail "router.discovery=dns connects to pod IPs: with tls.enabled set tls.serverName to a name the certificates carry (or router.discovery=static)" -}}
{{- end -}}
{{- end -}}

{{/* Volumes shared by every pod. */}}
{{- define "epd.volumes" -}}
- name: config
  configMap:
    name: {{ include "epd.configMapName" . }}
- name: cache
  emptyDir:
    sizeLimit: {{ .Values.cache.sizeLimit }}
- name: tmp
  emptyDir: {}
{{- if .Values.shm.enabled }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.shm.sizeLimit }}
{{- end }}
{{- if eq .Values.model.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required when model.source=pvc" .Values.model.pvc.claimName }}
    readOnly: true
{{- else if eq .Values.model.source "hostPath" }}
- name: model
  hostPath:
    path: {{ required "model.hostPath.path is required when model.source=hostPath" .Values.model.hostPath.path }}
    type: {{ .Values.model.hostPath.type }}
{{- else if or (eq .Values.model.source "hub") (eq .Values.model.source "s3") }}
- name: model  # filled by the fetch-model init container at each pod's start
  emptyDir:
    sizeLimit: {{ .Values.model.download.sizeLimit }}
{{- end }}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ required "tls.secretName is required when tls.enabled" .Values.tls.secretName }}
    defaultMode: 0440
{{- end }}
{{- with .Values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "epd.volumeMounts" -}}
- name: config
  mountPath: /etc/epd
  readOnly: true
- name: cache
  mountPath: /var/cache/epd
- name: tmp
  mountPath: /tmp
{{- if .Values.shm.enabled }}
- name: dshm
  mountPath: /dev/shm
{{- end }}
{{- if ne .Values.model.source "preset" }}
- name: model
  mountPath: {{ .Values.model.path }}
  readOnly: true
  {{- if and (eq .Values.model.source "pvc") .Values.model.pvc.subPath }}
  subPath: {{ .Values.model.pvc.subPath }}
  {{- end }}
{{- end }}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: {{ include "epd.tlsDir" . }}
  readOnly: true
{{- end }}
{{- with .Values.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "epd.env" -}}
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: EPD_CACHE_DIR
  value: /var/cache/epd
- name: HF_HOME
  value: /var/cache/epd/huggingface
- name: HF_HUB_OFFLINE
  value: "1"
- name: TRANSFORMERS_OFFLINE
  value: "1"
- name: PYTHONUNBUFFERED
  value: "1"
{{- if .Values.threadsFromCpuRequest }}
- name: OMP_NUM_THREADS
  valueFrom:
    resourceFieldRef:
      resource: requests.cpu
      divisor: "1"
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Pod scheduling of a tier: its own settings when set, else the release-wide ones. */}}
{{- define "epd.scheduling" -}}
{{- $root := .root -}}
{{- $t := index $root.Values .tier -}}
{{- $nodeSelector := $t.nodeSelector | default $root.Values.nodeSelector -}}
{{- $affinity := $t.affinity | default $root.Values.affinity -}}
{{- $tolerations := $t.tolerations | default $root.Values.tolerations | default list -}}
{{- if and $root.Values.gpu.enabled (ne .tier "router") $root.Values.gpu.tolerate (gt (int (include "epd.gpus" .)) 0) -}}
{{- $tolerations = append $tolerations (dict "key" $root.Values.gpu.resourceName "operator" "Exists" "effect" "NoSchedule") -}}
{{- end -}}
{{- with $nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $t.topologySpreadConstraints }}
{{- /* each constraint selects this tier's pods unless it names its own labelSelector */ -}}
{{- $spread := list }}
{{- range . }}
{{- $c := deepCopy . }}
{{- if not (hasKey $c "labelSelector") }}{{ $_ := set $c "labelSelector" (dict "matchLabels" (include "epd.selectorLabels" $ | fromYaml)) }}{{ end }}
{{- $spread = append $spread $c }}
{{- end }}
topologySpreadConstraints:
  {{- toYaml $spread | nindent 2 }}
{{- end }}
{{- with ($t.runtimeClassName | default $root.Values.runtimeClassName) }}
runtimeClassName: {{ . | quote }}
{{- end }}
{{- with ($t.priorityClassName | default $root.Values.priorityClassName) }}
priorityClassName: {{ . | quote }}
{{- end }}
{{- end -}}

{{/* The init container that brings the model into the pod (model.source hub or s3), or nothing. */}}
{{- define "epd.modelInitContainers" -}}
{{- $root := .root -}}
{{- $m := $root.Values.model -}}
{{- if or (eq $m.source "hub") (eq $m.source "s3") }}
initContainers:
  - name: fetch-model
    {{- if eq $m.source "hub" }}
    # the EPD image itself: huggingface-hub's `hf` comes with it
    image: {{ include "epd.image" . | quote }}
    imagePullPolicy: {{ include "epd.imagePullPolicy" . }}
    command: ["hf", "download", {{ required "model.hub.repo is required when model.source=hub" $m.hub.repo | quote }},
              "--revision", {{ $m.hub.revision | quote }}, "--local-dir", {{ $m.path | quote }}]
    env:
      - name: HF_HUB_OFFLINE  # the image is offline for serving; this container is the one that downloads
        value: "0"
      - name: HF_HOME
        value: /var/cache/epd/huggingface
      {{- with $m.download.secretName }}
      - name: HF_TOKEN
        valueFrom:
          secretKeyRef: {name: {{ . | quote }}, key: {{ $m.download.tokenKey | quote }}}
      {{- end }}
    {{- else }}
    image: {{ $m.s3.image | quote }}
    command: ["aws", "s3", "sync", {{ required "model.s3.url is required when model.source=s3" $m.s3.url | quote }},
              {{ $m.path | quote }}, "--only-show-errors"{{ with $m.s3.endpointUrl }}, "--endpoint-url", {{ . | quote }}{{ end }}]
    {{- with $m.download.secretName }}
    # AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (and AWS_REGION, AWS_SESSION_TOKEN) from the Secret
    envFrom:
      - secretRef: {name: {{ . | quote }}}
    {{- end }}
    {{- end }}
    securityContext:
      {{- toYaml $root.Values.securityContext | nindent 6 }}
    volumeMounts:
      - name: model
        mountPath: {{ $m.path }}
      - name: cache
        mountPath: /var/cache/epd
      - name: tmp
        mountPath: /tmp
{{- end }}
{{- end -}}

{{/* Container resources of a worker tier, with the GPU limit added when gpu.enabled. */}}
{{- define "epd.workerResources" -}}
{{- $root := .root -}}
{{- $t := index $root.Values .tier -}}
{{- $res := deepCopy ($t.resources | default dict) -}}
{{- $gpus := int (include "epd.gpus" .) -}}
{{- if gt $gpus 0 -}}
{{- $limits := get $res "limits" | default dict -}}
{{- $_ := set $limits $root.Values.gpu.resourceName $gpus -}}
{{- $_ := set $res "limits" $limits -}}
{{- end -}}
{{- toYaml $res -}}
{{- end -}}

{{/* HOST:PORT of the encoder cache store's Mooncake master: the one given, or the chart's. */}}
{{- define "epd.mooncakeMaster" -}}
{{- if .Values.encoderCacheStore.master -}}
{{- .Values.encoderCacheStore.master -}}
{{- else -}}
{{- printf "%s.%s.svc.%s:%d" (include "epd.tierName" (dict "root" . "tier" "mooncake")) .Release.Namespace .Values.clusterDomain (int .Values.encoderCacheStore.rpcPort) -}}
{{- end -}}
{{- end -}}
