{{/* Names and labels. */}}
{{- define "sluice.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "sluice.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "sluice.labels" -}}
app.kubernetes.io/name: {{ include "sluice.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "sluice.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{- define "sluice.databaseSecret" -}}
{{- if .Values.database.existingSecret -}}
{{- .Values.database.existingSecret -}}
{{- else -}}
{{- printf "%s-database" (include "sluice.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/*
sluice.workers: one entry per (pool, model) pair, the pool's settings merged
with the model entry's overrides, validated. Rendered as JSON for fromJson:
  {"items": [{"name", "pool", "model", "tp", "gpusPerPod", "replicas", ...}]}
*/}}
{{- define "sluice.workers" -}}
{{- $root := . -}}
{{- $partitions := dict -}}
{{- range .Values.models -}}
{{- $_ := set $partitions .name (int .partitions) -}}
{{- end -}}
{{- $items := list -}}
{{- $seen := dict -}}
{{- range $pool := .Values.pools -}}
{{- if not (regexMatch "^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$" (toString $pool.name)) -}}
{{- fail (printf "pool name %q is not valid (SLUICE_POOL pattern)" (toString $pool.name)) -}}
{{- end -}}
{{- range $entry := $pool.models -}}
{{- $override := ternary (dict "name" $entry) $entry (kindIs "string" $entry) -}}
{{- $base := omit (deepCopy $pool) "models" "name" -}}
{{- $w := mergeOverwrite $base (omit (deepCopy $override) "name") -}}
{{- $model := toString $override.name -}}
{{- if not (hasKey $partitions $model) -}}
{{- fail (printf "pool %s places model %q, which is missing from .Values.models" $pool.name $model) -}}
{{- end -}}
{{- $tp := int ($w.tp | default 1) -}}
{{- $gpus := int ($w.gpusPerPod | default $tp) -}}
{{- if lt $gpus $tp -}}
{{- fail (printf "%s/%s: gpusPerPod (%d) is less than tp (%d)" $pool.name $model $gpus $tp) -}}
{{- end -}}
{{- $min := int $w.replicas.min -}}
{{- $max := int $w.replicas.max -}}
{{- if or (lt $max 1) (lt $max $min) -}}
{{- fail (printf "%s/%s: replicas.max (%d) must be >= 1 and >= replicas.min (%d)" $pool.name $model $max $min) -}}
{{- end -}}
{{- if gt $max (get $partitions $model) -}}
{{- fail (printf "%s/%s: replicas.max (%d) exceeds the %d partitions of the request topic; extra replicas would sit idle" $pool.name $model $max (get $partitions $model)) -}}
{{- end -}}
{{- $raw := printf "%s-%s-%s" (include "sluice.fullname" $root) $pool.name $model | lower -}}
{{- $name := regexReplaceAll "[^a-z0-9-]" $raw "-" | trunc 63 | trimSuffix "-" -}}
{{- if hasKey $seen $name -}}
{{- fail (printf "two workers render to the same name %s" $name) -}}
{{- end -}}
{{- $_ := set $seen $name true -}}
{{- $_ := set $w "name" $name -}}
{{- $_ := set $w "pool" (toString $pool.name) -}}
{{- $_ := set $w "model" $model -}}
{{- $_ := set $w "tp" $tp -}}
{{- $_ := set $w "gpusPerPod" $gpus -}}
{{- $_ := set $w "minReplicas" $min -}}
{{- $_ := set $w "maxReplicas" $max -}}
{{- $items = append $items $w -}}
{{- end -}}
{{- end -}}
{{- dict "items" $items | toJson -}}
{{- end -}}

{{/* The workload kind of every worker: StatefulSet (stable member ids) or Deployment. */}}
{{- define "sluice.workerKind" -}}
{{- $kind := .Values.worker.kind | default "StatefulSet" -}}
{{- if not (has $kind (list "StatefulSet" "Deployment")) -}}
{{- fail (printf "worker.kind %q is not StatefulSet or Deployment" (toString $kind)) -}}
{{- end -}}
{{- $kind -}}
{{- end -}}

{{/* Labels telling one (pool, model) worker from another; call with (dict "root" $ "w" $worker). */}}
{{- define "sluice.workerLabels" -}}
app.kubernetes.io/component: worker
sluice.dev/pool: {{ .w.pool | quote }}
sluice.dev/model: {{ .w.model | quote }}
{{- end -}}

{{- define "sluice.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sluice.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{ include "sluice.workerLabels" . }}
{{- end -}}

{{/*
Kafka security of every sluice client (SLUICE_KAFKA__*): env entries, and one
projected volume with the secrets as files (never in the pod spec itself).
*/}}
{{- define "sluice.kafkaSecurityCheck" -}}
{{- $s := .Values.kafka.security | default dict -}}
{{- $protocol := $s.protocol | default "PLAINTEXT" -}}
{{- if not (has $protocol (list "PLAINTEXT" "SSL" "SASL_PLAINTEXT" "SASL_SSL")) -}}
{{- fail (printf "kafka.security.protocol %q is not PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL" $protocol) -}}
{{- end -}}
{{- $sasl := has $protocol (list "SASL_PLAINTEXT" "SASL_SSL") -}}
{{- if and $sasl (not $s.saslMechanism) -}}
{{- fail (printf "kafka.security.protocol %s needs kafka.security.saslMechanism (PLAIN, SCRAM-SHA-256, SCRAM-SHA-512 or OAUTHBEARER)" $protocol) -}}
{{- end -}}
{{- if and $sasl (has $s.saslMechanism (list "PLAIN" "SCRAM-SHA-256" "SCRAM-SHA-512")) -}}
{{- if not (or $s.username $s.usernameSecret) -}}
{{- fail (printf "kafka.security.saslMechanism %s needs kafka.security.username (or usernameSecret)" $s.saslMechanism) -}}
{{- end -}}
{{- if not $s.passwordSecret -}}
{{- fail (printf "kafka.security.saslMechanism %s needs kafka.security.passwordSecret ({name, key})" $s.saslMechanism) -}}
{{- end -}}
{{- end -}}
{{- if and $sasl (eq $s.saslMechanism "OAUTHBEARER") (not $s.oauthTokenSecret) -}}
{{- fail "kafka.security.saslMechanism OAUTHBEARER needs kafka.security.oauthTokenSecret ({name, key})" -}}
{{- end -}}
{{- end -}}

{{- define "sluice.kafkaSecurityEnv" -}}
{{- include "sluice.kafkaSecurityCheck" . -}}
{{- $s := .Values.kafka.security | default dict -}}
{{- $protocol := $s.protocol | default "PLAINTEXT" -}}
{{- $dir := "/etc/sluice/kafka" -}}
- name: SLUICE_KAFKA__SECURITY_PROTOCOL
  value: {{ $protocol | quote }}
{{- if has $protocol (list "SASL_PLAINTEXT" "SASL_SSL") }}
- name: SLUICE_KAFKA__SASL_MECHANISM
  value: {{ $s.saslMechanism | quote }}
{{- if eq $s.saslMechanism "OAUTHBEARER" }}
- name: SLUICE_KAFKA__SASL_OAUTH_TOKEN_FILE
  value: {{ printf "%s/oauth-token" $dir | quote }}
{{- else }}
{{- if $s.usernameSecret }}
- name: SLUICE_KAFKA__SASL_USERNAME_FILE
  value: {{ printf "%s/username" $dir | quote }}
{{- else }}
- name: SLUICE_KAFKA__SASL_USERNAME
  value: {{ $s.username | quote }}
{{- end }}
- name: SLUICE_KAFKA__SASL_PASSWORD_FILE
  value: {{ printf "%s/password" $dir | quote }}
{{- end }}
{{- end }}
{{- if has $protocol (list "SSL" "SASL_SSL") }}
{{- if $s.caSecret }}
- name: SLUICE_KAFKA__SSL_CAFILE
  value: {{ printf "%s/ca.pem" $dir | quote }}
{{- end }}
{{- if $s.clientCertSecret }}
- name: SLUICE_KAFKA__SSL_CERTFILE
  value: {{ printf "%s/client.crt" $dir | quote }}
- name: SLUICE_KAFKA__SSL_KEYFILE
  value: {{ printf "%s/client.key" $dir | quote }}
{{- end }}
{{- if eq (toString $s.checkHostname) "false" }}
- name: SLUICE_KAFKA__SSL_CHECK_HOSTNAME
  value: "false"
{{- end }}
{{- end }}
{{- with .Values.database.caSecret }}
- name: SLUICE_DATABASE__SSL_CAFILE
  value: "/etc/sluice/database/ca.pem"
{{- end }}
{{- end -}}

{{/* The projected volume's sources (empty when no secret is named). */}}
{{- define "sluice.kafkaSecretSources" -}}
{{- $s := .Values.kafka.security | default dict -}}
{{- $sources := list -}}
{{- with $s.usernameSecret }}
{{- $sources = append $sources (dict "secret" (dict "name" .name "items" (list (dict "key" (.key | default "username") "path" "username")))) -}}
{{- end }}
{{- with $s.passwordSecret }}
{{- $sources = append $sources (dict "secret" (dict "name" .name "items" (list (dict "key" (.key | default "password") "path" "password" "mode" 256)))) -}}
{{- end }}
{{- with $s.oauthTokenSecret }}
{{- $sources = append $sources (dict "secret" (dict "name" .name "items" (list (dict "key" (.key | default "token") "path" "oauth-token" "mode" 256)))) -}}
{{- end }}
{{- with $s.caSecret }}
{{- $sources = append $sources (dict "secret" (dict "name" .name "items" (list (dict "key" (.key | default "ca.pem") "path" "ca.pem")))) -}}
{{- end }}
{{- with $s.clientCertSecret }}
{{- $sources = append $sources (dict "secret" (dict "name" .name "items" (list (dict "key" (.certKey | default "tls.crt") "path" "client.crt") (dict "key" (.keyKey | default "tls.key") "path" "client.key" "mode" 256)))) -}}
{{- end }}
{{- dict "sources" $sources | toJson -}}
{{- end -}}
