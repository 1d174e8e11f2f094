{{/* Names and labels shared by every template. */}}
{{- define "continuum-router.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "continuum-router.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "continuum-router.labels" -}}
{{ include "continuum-router.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "continuum-router.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "continuum-router.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* 1 when config.dynamo.event_bus.enabled, else empty. */}}
{{- define "continuum-router.busEnabled" -}}
{{- if dig "dynamo" "event_bus" "enabled" false .Values.config -}}1{{- end -}}
{{- end -}}

{{/* The event-bus listener's port, from config.dynamo.event_bus.listen (default 7443). */}}
{{- define "continuum-router.busPort" -}}
{{- dig "dynamo" "event_bus" "listen" "0.0.0.0:7443" .Values.config | splitList ":" | last -}}
{{- end -}}

{{/* The front door's port, from config.server.bind_address (default 8080). */}}
{{- define "continuum-router.httpPort" -}}
{{- dig "server" "bind_address" "127.0.0.1:8080" .Values.config | splitList ":" | last -}}
{{- end -}}
