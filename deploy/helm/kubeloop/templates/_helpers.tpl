{{/* The kubeloop image every kubeloop container runs. */}}
{{- define "kubeloop.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end }}

{{/* external-snapshotter's image (snapshot-controller and csi-snapshotter). */}}
{{- define "kubeloop.snapshotMetadataImage" -}}
{{ .Values.snapshotMetadata.image.repository }}:{{ .Values.snapshotMetadata.image.tag }}
{{- end }}

{{- define "kubeloop.snapshotterImage" -}}
{{ .Values.snapshotter.image.repository }}:{{ .Values.snapshotter.image.tag }}
{{- end }}
