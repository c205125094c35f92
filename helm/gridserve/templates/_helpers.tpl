{{/* Names. */}}
{{- define "gridserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 30 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 30 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "gridserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "gridserve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Labels: the selector labels of a role (dict "root" $ "role" "gateway"), and all labels. */}}
{{- define "gridserve.selectorLabels" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .role }}
{{- end -}}

{{- define "gridserve.labels" -}}
{{ include "gridserve.selectorLabels" . }}
app.kubernetes.io/part-of: gridserve
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{/* The image of a role: its own repository/tag, else <registry>/<prefix>-<role>:<tag>. */}}
{{- define "gridserve.image" -}}
{{- $v := .root.Values -}}
{{- $own := (index $v .role).image -}}
{{- $repo := $own.repository -}}
{{- if not $repo -}}
{{- $repo = printf "%s-%s" $v.image.prefix .role -}}
{{- if $v.image.registry -}}{{- $repo = printf "%s/%s" $v.image.registry $repo -}}{{- end -}}
{{- end -}}
{{- $tag := $own.tag | default $v.image.tag | default .root.Chart.AppVersion -}}
{{- printf "%s:%s" $repo (toString $tag) -}}
{{- end -}}

{{/* Parallel shape. */}}
{{- define "gridserve.apiServerCount" -}}
{{- if kindIs "invalid" .Values.apiServerCount -}}{{ include "gridserve.dataParallelSize" . }}{{- else -}}{{ .Values.apiServerCount }}{{- end -}}
{{- end -}}

{{- define "gridserve.coordinatorEnabled" -}}
{{- if gt (int (include "gridserve.dataParallelSize" .)) 1 -}}true{{- end -}}
{{- end -}}

{{/* Engines (DP ranks): dataParallelSize, or with disaggregated.enabled the prefill engines
     (ranks 0 .. P-1, --kv-role kv_producer) then the decode engines (kv_consumer). */}}
{{- define "gridserve.dataParallelSize" -}}
{{- if .Values.disaggregated.enabled -}}
{{- add (int .Values.disaggregated.prefill.replicas) (int .Values.disaggregated.decode.replicas) -}}
{{- else -}}
{{- .Values.dataParallelSize -}}
{{- end -}}
{{- end -}}

{{/* The --kv-role of the engine of DP rank .rank ("" when not disaggregated). */}}
{{- define "gridserve.kvRole" -}}
{{- $d := .root.Values.disaggregated -}}
{{- if $d.enabled -}}{{ ternary "kv_producer" "kv_consumer" (lt (int .rank) (int $d.prefill.replicas)) }}{{- end -}}
{{- end -}}

{{/* "true" when the engine of DP rank .rank is a KEDA standby of its disaggregated pool (keda.enabled,
     its index in the pool >= the pool's minReplicas): KEDA owns its replica count (and its workers'). */}}
{{- define "gridserve.kedaStandby" -}}
{{- $d := .root.Values.disaggregated -}}
{{- if and .root.Values.keda.enabled $d.enabled -}}
{{- $prefill := lt (int .rank) (int $d.prefill.replicas) -}}
{{- $p := ternary $d.prefill $d.decode $prefill -}}
{{- $index := ternary (int .rank) (sub (int .rank) (int $d.prefill.replicas)) $prefill -}}
{{- if and (not (kindIs "invalid" $p.minReplicas)) (ge (int $index) (int $p.minReplicas)) -}}true{{- end -}}
{{- end -}}
{{- end -}}

{{/* Stable DNS names. */}}
{{- define "gridserve.svcSuffix" -}}
{{- printf "%s.svc.%s" .Release.Namespace .Values.clusterDomain -}}
{{- end -}}

{{/* Engine of DP rank r: pod 0 of StatefulSet <fullname>-engine-<r>, headless Service <fullname>-engine. */}}
{{- define "gridserve.engineAddress" -}}
{{- $full := include "gridserve.fullname" .root -}}
{{- printf "%s-engine-%d-0.%s-engine.%s:%d" $full (int .rank) $full (include "gridserve.svcSuffix" .root) (int .root.Values.engine.port) -}}
{{- end -}}

{{- define "gridserve.engineAddresses" -}}
{{- $addrs := list -}}
{{- range $r := until (int (include "gridserve.dataParallelSize" .)) -}}
{{- $addrs = append $addrs (include "gridserve.engineAddress" (dict "root" $ "rank" $r)) -}}
{{- end -}}
{{- join "," $addrs -}}
{{- end -}}

{{/* Workers of DP rank r in rank order (pp stage major, tp rank minor): pod t of StatefulSet
     <fullname>-worker-<r>-<p>, headless Service <fullname>-worker. */}}
{{- define "gridserve.workerAddresses" -}}
{{- $root := .root -}}
{{- $full := include "gridserve.fullname" $root -}}
{{- $addrs := list -}}
{{- range $p := until (int $root.Values.pipelineParallelSize) -}}
{{- range $t := until (int $root.Values.tensorParallelSize) -}}
{{- $addrs = append $addrs (printf "%s-worker-%d-%d-%d.%s-worker.%s:%d" $full (int $.rank) $p $t $full (include "gridserve.svcSuffix" $root) (int $root.Values.worker.port)) -}}
{{- end -}}
{{- end -}}
{{- join "," $addrs -}}
{{- end -}}

{{- define "gridserve.coordinatorAddress" -}}
{{- printf "%s-coordinator.%s:%d" (include "gridserve.fullname" .) (include "gridserve.svcSuffix" .) (int .Values.coordinator.port) -}}
{{- end -}}

{{- define "gridserve.modelName" -}}
{{- if eq .Values.model.source "hub" -}}
{{- .Values.model.id -}}
{{- else -}}
{{- printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) (trimPrefix "/" .Values.model.path) | trimSuffix "/" -}}
{{- end -}}
{{- end -}}

{{/* Environment every gridserve role shares: observability and the model cache. */}}
{{- define "gridserve.commonEnv" -}}
- name: GRIDSERVE_HOST
  value: "0.0.0.0"
- name: OTEL_SERVICE_NAME
  value: gridserve-{{ .role }}
- name: GRIDSERVE_LOG_FORMAT
  value: {{ .root.Values.logFormat | quote }}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
{{- if .root.Values.metrics.enabled }}
- name: GRIDSERVE_METRICS_PORT
  value: {{ .root.Values.metrics.port | quote }}
{{- end }}
{{- with .root.Values.otlp.tracesEndpoint }}
- name: GRIDSERVE_OTLP_TRACES_ENDPOINT
  value: {{ . | quote }}
{{- end }}
- name: HF_HOME
  value: {{ printf "%s/hf" (trimSuffix "/" .root.Values.model.mountPath) | quote }}
- name: HF_HUB_OFFLINE
  value: "1"
- name: GRIDSERVE_HEALTH_PORT
  value: {{ .root.Values.tls.healthPort | quote }}
{{- if .root.Values.tls.enabled }}
{{- $dir := trimSuffix "/" .root.Values.tls.mountPath }}
- name: GRIDSERVE_TLS_CERT_FILE
  value: {{ printf "%s/tls.crt" $dir | quote }}
- name: GRIDSERVE_TLS_KEY_FILE
  value: {{ printf "%s/tls.key" $dir | quote }}
- name: GRIDSERVE_TLS_CA_FILE
  value: {{ printf "%s/ca.crt" $dir | quote }}
- name: GRIDSERVE_TLS_DEPLOYMENT
  value: {{ include "gridserve.tlsDeployment" .root | quote }}
{{- with .root.Values.tls.certManager.spiffeTrustDomain }}
- name: GRIDSERVE_TLS_TRUST_DOMAIN
  value: {{ . | quote }}
{{- end }}
{{- else }}
{{- /* Plaintext roles listen on the pod's address only when told so (--insecure-internal): the
       chart's NetworkPolicies are then what keeps others from calling them. */}}
- name: GRIDSERVE_INSECURE_INTERNAL
  value: "1"
{{- end }}
{{- end -}}

{{/* The Secret holding a role's certificate, key and CA (dict "root" $ "role" "worker"; an engine's is
     its DP rank's own, "role" "engine-<rank>"). */}}
{{- define "gridserve.tlsSecretName" -}}
{{- printf "%s-tls-%s" (include "gridserve.fullname" .root) .role -}}
{{- end -}}

{{/* A role's TLS volume and its read-only mount (nothing when tls.enabled is false). */}}
{{- define "gridserve.tlsVolume" -}}
{{- if .root.Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "gridserve.tlsSecretName" . }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{- define "gridserve.tlsMount" -}}
{{- if .root.Values.tls.enabled }}
- name: tls
  mountPath: {{ .root.Values.tls.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{/* The deployment every role's peers must belong to (GRIDSERVE_TLS_DEPLOYMENT), and the gateways the
     edge dials (files/envoy.json.tpl): <fullname>.<namespace>, unique in the cluster, so a
     certificate of another release or namespace from a shared issuer names no role here. */}}
{{- define "gridserve.tlsDeployment" -}}
{{- printf "%s.%s" (include "gridserve.fullname" .) .Release.Namespace -}}
{{- end -}}

{{/* DNS names a role's certificate carries: <role>.<deployment>.gridserve.internal (its identity;
     with "instance", also <role>-<instance>.<deployment>.gridserve.internal; the edge's Envoy takes a
     gateway by gateway.<deployment>.gridserve.internal, files/envoy.json.tpl), the unscoped
     <role>.gridserve.internal (which neither the roles nor the edge match now) and the Service /
     pod names its clients dial (hostname verification). */}}
{{- define "gridserve.tlsDnsNames" -}}
{{- $full := include "gridserve.fullname" .root -}}
{{- $suffix := include "gridserve.svcSuffix" .root -}}
{{- $deployment := include "gridserve.tlsDeployment" .root -}}
{{- $names := list (printf "%s.%s.gridserve.internal" .role $deployment) -}}
{{- if not (kindIs "invalid" .instance) -}}
{{- $names = append $names (printf "%s-%v.%s.gridserve.internal" .role .instance $deployment) -}}
{{- end -}}
{{- $names = append $names (printf "%s.gridserve.internal" .role) -}}
{{- range $svc := list (printf "%s-%s" $full .role) (printf "%s-%s-headless" $full .role) -}}
{{- $names = concat $names (list $svc (printf "%s.%s" $svc $suffix) (printf "*.%s" $svc) (printf "*.%s.%s" $svc $suffix)) -}}
{{- end -}}
{{- toJson $names -}}
{{- end -}}

{{/* The container ports of a role: gRPC, the plaintext health port of the probes, plus metrics. */}}
{{- define "gridserve.ports" -}}
- name: grpc
  containerPort: {{ .port }}
  protocol: TCP
- name: health
  containerPort: {{ .root.Values.tls.healthPort }}
  protocol: TCP
{{- if .root.Values.metrics.enabled }}
- name: metrics
  containerPort: {{ .root.Values.metrics.port }}
  protocol: TCP
{{- end }}
{{- end -}}

{{/* Native gRPC probes on the plaintext health port (grpc.health.v1 alone; kubelet's probes cannot
     speak TLS): startup and readiness ask service "" (READY), liveness asks service "liveness"
     (alive: not DEAD, the loop's watchdog beating), so a sleeping or recovering role is taken out of
     rotation without being restarted. */}}
{{- define "gridserve.probes" -}}
{{- $p := .root.Values.probes -}}
startupProbe:
  grpc:
    port: {{ .root.Values.tls.healthPort }}
  periodSeconds: {{ $p.startup.periodSeconds }}
  failureThreshold: {{ $p.startup.failureThreshold }}
  timeoutSeconds: 5
readinessProbe:
  grpc:
    port: {{ .root.Values.tls.healthPort }}
    service: ""
  periodSeconds: {{ $p.readiness.periodSeconds }}
  failureThreshold: {{ $p.readiness.failureThreshold }}
  timeoutSeconds: 5
livenessProbe:
  grpc:
    port: {{ .root.Values.tls.healthPort }}
    service: liveness
  periodSeconds: {{ $p.liveness.periodSeconds }}
  failureThreshold: {{ $p.liveness.failureThreshold }}
  timeoutSeconds: 5
{{- end -}}

{{- define "gridserve.podSecurityContext" -}}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end -}}

{{- define "gridserve.securityContext" -}}
securityContext:
  {{- toYaml .Values.securityContext | nindent 2 }}
{{- end -}}

{{/* Pod-level settings every role shares. */}}
{{- define "gridserve.podCommon" -}}
serviceAccountName: {{ include "gridserve.serviceAccountName" . }}
automountServiceAccountToken: false
enableServiceLinks: false
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{ include "gridserve.podSecurityContext" . }}
{{- end -}}

{{/* The model volume (gateway, engine, worker) and its hub-fetch init container. */}}
{{- define "gridserve.modelVolume" -}}
{{- $m := .Values.model -}}
- name: model
{{- if eq $m.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ $m.pvc.claimName }}
    readOnly: true
{{- else if eq $m.source "hostPath" }}
  hostPath:
    path: {{ $m.hostPath.path }}
    type: Directory
{{- else if $m.cache.claimName }}
  persistentVolumeClaim:
    claimName: {{ $m.cache.claimName }}
{{- else }}
  emptyDir:
    sizeLimit: {{ $m.cache.sizeLimit }}
{{- end }}
- name: tmp
  emptyDir: {}
{{- end -}}

{{- define "gridserve.modelMount" -}}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: {{ ne .Values.model.source "hub" }}
- name: tmp
  mountPath: /tmp
{{- end -}}

{{/* Init container fetching a hub model into the pod's model cache (the engine image: no torch). */}}
{{- define "gridserve.fetchModel" -}}
{{- if eq .Values.model.source "hub" }}
initContainers:
  - name: fetch-model
    image: {{ include "gridserve.image" (dict "root" . "role" "engine") }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    command:
      - python
      - -c
      - "import os; from gridserve.shared.hf import resolve_model_path; print(resolve_model_path(os.environ['GRIDSERVE_MODEL']))"
    env:
      - name: GRIDSERVE_MODEL
        value: {{ .Values.model.id | quote }}
      - name: HF_HOME
        value: {{ printf "%s/hf" (trimSuffix "/" .Values.model.mountPath) | quote }}
      - name: HOME
        value: /tmp/home
      {{- if .Values.model.hfTokenSecret.name }}
      - name: HF_TOKEN
        valueFrom:
          secretKeyRef:
            name: {{ .Values.model.hfTokenSecret.name }}
            key: {{ .Values.model.hfTokenSecret.key }}
      {{- end }}
    resources:
      requests: {cpu: 250m, memory: 512Mi}
      limits: {cpu: "1", memory: 2Gi}
    {{- include "gridserve.securityContext" . | nindent 4 }}
    volumeMounts:
      {{- include "gridserve.modelMount" . | nindent 6 }}
{{- end }}
{{- end -}}

{{/* Multi-LoRA: the engine's LoRA options (lora.*) as its GRIDSERVE_* variables; nothing when off. */}}
{{- define "gridserve.loraEnv" -}}
{{- $l := .Values.lora -}}
{{- if $l.enabled }}
- name: GRIDSERVE_ENABLE_LORA
  value: "1"
- name: GRIDSERVE_MAX_LORAS
  value: {{ $l.maxLoras | int64 | toString | quote }}
- name: GRIDSERVE_MAX_LORA_RANK
  value: {{ $l.maxLoraRank | int64 | toString | quote }}
{{- if $l.maxCpuLoras }}
- name: GRIDSERVE_MAX_CPU_LORAS
  value: {{ $l.maxCpuLoras | int64 | toString | quote }}
{{- end }}
{{- if $l.dir }}
- name: GRIDSERVE_LORA_DIR
  value: {{ $l.dir | quote }}
{{- end }}
{{- if $l.modules }}
- name: GRIDSERVE_LORA_MODULES
  value: {{ $l.modules | toJson | quote }}
{{- end }}
{{- if $l.allowRuntimeUpdating }}
- name: GRIDSERVE_ALLOW_RUNTIME_LORA_UPDATING
  value: "1"
{{- end }}
{{- end }}
{{- end -}}

{{/* The adapters' volume (lora.volume), read-only at lora.dir, on the engine and worker pods. */}}
{{- define "gridserve.loraVolume" -}}
{{- if and .Values.lora.enabled .Values.lora.volume }}
- name: lora-adapters
  {{- toYaml .Values.lora.volume | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "gridserve.loraMount" -}}
{{- if and .Values.lora.enabled .Values.lora.volume }}
- name: lora-adapters
  mountPath: {{ .Values.lora.dir }}
  readOnly: true
{{- end }}
{{- end -}}
