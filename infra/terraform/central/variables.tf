variable "aws_region" {
  description = "AWS region of the central weights bucket (where the trainers publish)."
  type        = string
}

variable "bucket" {
  description = "Name of the central weights bucket (the bucket of the trainers' --store URL)."
  type        = string
}

variable "weights_prefix" {
  description = "Key prefix the weightstore writes under, with its trailing slash (the path of the --store URL)."
  type        = string
  default     = "weights/"
}

variable "replicas" {
  description = "Regional replica buckets, keyed by rlbus region name; bucket_arn comes from the region root's output."
  type = map(object({
    bucket_arn = string
  }))
  default = {}
}

variable "noncurrent_version_days" {
  description = "Days a replaced LATEST pointer or a retired chunk stays as a noncurrent version."
  type        = number
  default     = 3
}
